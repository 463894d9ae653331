"""An estimator worker of the kill/restart test: trains a linear model on leased shards and
counts, in a checkpointed variable, how often each record was trained.

argv: ckpt_dir model_dir coordinator_url worker_name num_records pause_at_step(0: never) out_json
      [hold_at_step path]: after that step, wait until path exists (so that the other
      worker is killed while this one is mid-run)
writes out_json + ".started" after its first step: it holds its first leases then
"""

import json
import os
import sys
import time

import tensorflow as tf

import elastic.tf as etf
from flashckpt import _events
from flashckpt.tf import FlashCheckpointHook

ckpt_dir, model_dir, url, worker, n, pause_at, out = sys.argv[1:8]
N, PAUSE = int(n), int(pause_at)
HOLD, HOLD_UNTIL = (int(sys.argv[8]), sys.argv[9]) if len(sys.argv) > 9 else (0, "")
loads = []
_events.subscribe(lambda event, **info: loads.append(info) if event == "load" else None)


def reader(shard):
    ids = shard.indices
    x = tf.cast(ids, tf.float32)[:, None] / N
    return tf.data.Dataset.from_tensor_slices(({"id": ids, "x": x}, 2.0 * x[:, 0]))


def model_fn(features, labels, mode):
    w = tf.compat.v1.get_variable("w", [1, 1], use_resource=True)
    seen = tf.compat.v1.get_variable("seen", [N], tf.int64, initializer=tf.compat.v1.zeros_initializer(),
                                     trainable=False, use_resource=True)
    loss = tf.reduce_mean((tf.matmul(features["x"], w)[:, 0] - labels) ** 2)
    count = tf.compat.v1.scatter_add(seen, features["id"], tf.ones_like(features["id"]))
    with tf.control_dependencies([count]):
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


class Pause(tf.estimator.SessionRunHook):
    """Say when training started; after global step PAUSE, say so and wait to be killed."""

    def before_run(self, run_context):
        return tf.estimator.SessionRunArgs(tf.compat.v1.train.get_global_step())

    def after_run(self, run_context, run_values):
        if not os.path.exists(out + ".started"):
            open(out + ".started", "w").close()
        if HOLD and run_values.results + 1 == HOLD:
            deadline = time.monotonic() + 240
            while not os.path.exists(HOLD_UNTIL) and time.monotonic() < deadline:
                time.sleep(0.05)
        if PAUSE and run_values.results + 1 >= PAUSE:
            with open(out + ".paused", "w") as f:
                f.write(str(run_values.results + 1))
            time.sleep(600)


input_fn = etf.make_input_fn(reader, coordinator=url, name="train", size=N, shard_size=20, batch_size=8,
                             num_epochs=1, worker=worker, lease_timeout=30.0)
config = tf.estimator.RunConfig(model_dir=model_dir, save_checkpoints_steps=None, save_checkpoints_secs=None,
                                save_summary_steps=None, log_step_count_steps=100000)
estimator = tf.estimator.Estimator(model_fn, config=config)
hook = FlashCheckpointHook(ckpt_dir, every_steps=4)
estimator.train(input_fn, hooks=[hook, Pause()])
hook.close()
with open(out, "w") as f:
    json.dump({"restored": hook.restored_step, "loads": loads, "last_saved": hook.last_saved}, f)
