"""FlashCheckpointHook in one process: a second train call restores from memory, the
data positions ride along, and the export is a TF1 checkpoint estimators read."""

import numpy as np
import tensorflow as tf

import elastic.tf as etf
import sharding
from flashckpt import _events
from flashckpt.tf import FlashCheckpointHook


def test_second_train_call_restores_from_memory_and_export_is_a_stock_checkpoint(tmp_path, job_id):
    n, batch = 60, 6
    url = f"sqlite:///{tmp_path}/c.db"
    loads = []

    def listen(event, **info):
        if event == "load":
            loads.append(info)

    def reader(shard):
        x = tf.cast(shard.indices, tf.float32)[:, None] / n
        return tf.data.Dataset.from_tensor_slices(({"x": x}, 2.0 * x[:, 0]))

    def model_fn(features, labels, mode):
        w = tf.compat.v1.get_variable("w", [1, 1], use_resource=True)
        loss = tf.reduce_mean((tf.matmul(features["x"], w)[:, 0] - labels) ** 2)
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    input_fn = etf.make_input_fn(reader, coordinator=url, name="train", size=n, shard_size=12, batch_size=batch,
                                 num_epochs=2, worker="est")
    config = tf.estimator.RunConfig(model_dir=str(tmp_path / "model"), save_checkpoints_steps=None,
                                    save_checkpoints_secs=None, save_summary_steps=None)
    hook = FlashCheckpointHook(tmp_path / "ck", every_steps=4, export=True, job_id=job_id)
    passes = 0
    _events.subscribe(listen)
    try:
        while not input_fn.finished():  # one train call per epoch
            tf.estimator.Estimator(model_fn, config=config).train(input_fn, hooks=[hook])
            passes += 1
    finally:
        _events.unsubscribe(listen)
        hook.close()
    assert passes == 2
    assert loads[0]["step"] is None
    assert (loads[1]["step"], loads[1]["source"]) == (n // batch, "memory")
    assert hook.last_saved == 2 * n // batch
    progress = sharding.connect(url).dataset("train").progress()
    assert progress["finished"] and progress["leased"] == 0
    reader_ = tf.train.load_checkpoint(str(tmp_path / "ck" / f"step-{hook.last_saved}" / "tf"))
    assert reader_.get_tensor("global_step") == hook.last_saved
    w = reader_.get_tensor("w")
    assert w.shape == (1, 1) and np.isfinite(w).all()
