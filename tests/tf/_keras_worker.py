"""A Keras worker of the kill/restart test: fits on leased shards with the flash callback,
records the weights at every save, and counts in a model variable how often each record
was trained.

argv: ckpt_dir coordinator_url num_records pause_at_step(0: never) out_dir [background]
"""

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import elastic.tf as etf
from flashckpt import _events
from flashckpt.tf import FlashCheckpointCallback

ckpt_dir, url, n, pause_at, out = sys.argv[1:6]
N, PAUSE = int(n), int(pause_at)
BACKGROUND = sys.argv[6:7] == ["background"]
loads = []
_events.subscribe(lambda event, **info: loads.append(info) if event == "load" else None)


class Counting(tf.keras.Model):
    """A linear model that also counts, per record id, how often it was trained on."""

    def __init__(self):
        super().__init__()
        self.dense = tf.keras.layers.Dense(1)
        self.seen = tf.Variable(tf.zeros([N], tf.int64), trainable=False)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        features, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((self(features["x"])[:, 0] - y) ** 2)
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.dense.trainable_variables),
                                           self.dense.trainable_variables))
        self.seen.scatter_add(tf.IndexedSlices(tf.ones_like(features["id"]), features["id"]))
        return {"loss": loss}


def reader(shard):
    ids = shard.indices
    x = tf.stack([tf.cast(ids, tf.float32) / N, tf.ones_like(ids, tf.float32)], axis=1)
    return tf.data.Dataset.from_tensor_slices(({"id": ids, "x": x}, 3.0 * x[:, 0] + 1.0))


def snapshot(model):
    return {v.name + f"#{i}": v.numpy() for i, v in enumerate(model.variables + model.optimizer.variables)}


class Recorder(tf.keras.callbacks.Callback):
    """Writes the weights at every flash save; compares them after a restore; pauses."""

    def __init__(self, flash):
        super().__init__()
        self.flash, self.result = flash, {}

    def on_train_begin(self, logs=None):
        step = self.flash.restored_step
        self.result["restored"] = step
        if step:
            saved = np.load(os.path.join(out, f"weights-{step}.npz"))
            now = snapshot(self.model)
            self.result["equal"] = sorted(saved.files) == sorted(now) and all(
                np.array_equal(saved[k], now[k]) for k in saved.files)

    def on_train_batch_end(self, batch, logs=None):
        if self.flash._saved == self.flash.step:
            np.savez(os.path.join(out, f"weights-{self.flash.step}.npz"), **snapshot(self.model))
        if PAUSE and self.flash.step >= PAUSE:
            with open(os.path.join(out, "paused"), "w") as f:
                f.write(str(self.flash.step))
            time.sleep(600)


shards = etf.ShardDataset(url, "train", size=N, shard_size=16, num_epochs=1, worker="keras-0")
model = Counting()
model.compile(optimizer=tf.keras.optimizers.Adam(0.01))
model(tf.zeros([1, 2]))
flash = FlashCheckpointCallback(ckpt_dir, every_steps=3, data=shards, batch_size=8, background=BACKGROUND)
recorder = Recorder(flash)
model.fit(shards.flat_map(reader).batch(8), epochs=1, verbose=0, callbacks=[flash, recorder])
flash.close()
recorder.result.update(loads=loads, step=flash.step, seen=model.seen.numpy().tolist())
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump(recorder.result, f)
