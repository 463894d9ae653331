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


def test_hook_loads_into_the_variables_own_buffers_and_assigns_only_copy_on_read_ones(tmp_path, job_id, caplog):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.get_or_create_global_step()
        dense = tf.compat.v1.get_variable("dense", [6, 4], use_resource=True)
        table = tf.compat.v1.get_variable("table", [10, 4], use_resource=True)
        half = tf.compat.v1.get_variable("half", [3], tf.bfloat16, use_resource=True)
        lookup = tf.nn.embedding_lookup(table, [1, 2])  # sparse access: reads of table become copies
        address = tf.numpy_function(lambda a: np.int64(a.ctypes.data), [dense.value()], tf.int64, stateful=True)
        variables = [dense, table, half]
        zero = tf.group(*[v.assign(tf.zeros_like(v)) for v in variables])
        hook = FlashCheckpointHook(tmp_path, every_steps=1 << 30, job_id=job_id)
        hook.begin()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(lookup)
            hook.after_create_session(sess, None)
            assert hook.restored_step is None
            hook._save(sess, 5)
            expected = sess.run(variables)
            sess.run(zero)
            before = sess.run(address)
            caplog.set_level("DEBUG", logger="flashckpt.tf")
            hook.after_create_session(sess, None)
            assert hook.restored_step == 5
            assert all(np.array_equal(a, b) for a, b in zip(sess.run(variables), expected))
            assert sess.run(address) == before  # dense was written in place
        hook.close()
    assigned = caplog.text.split("copies): ")[1].strip().split(", ")
    assert assigned == ["global_step", "table"]  # after sparse access; a 0-d value comes as a copy


class _Values(tf.estimator.SessionRunHook):
    """Every global variable's value (copied), once the session exists or at its end."""

    def __init__(self, at_start: bool) -> None:
        self.at_start, self.values = at_start, None

    def begin(self):
        self.variables = tf.compat.v1.global_variables()

    def _read(self, session):
        self.values = {v.op.name: np.array(session.run(v), copy=True) for v in self.variables}

    def after_create_session(self, session, coord):
        if self.at_start:
            self._read(session)

    def end(self, session):
        if not self.at_start:
            self._read(session)


def test_a_restore_into_fresh_adam_slots_gives_every_variable_its_own_value(tmp_path, job_id):
    """Freshly initialised variables (Adam's zero slots) may share one buffer in a new
    session: the restore wrote them all through it (biases and slots came back with
    another slot's values)."""
    def input_fn():
        x = np.random.RandomState(0).randn(16, 8).astype("float32")
        return tf.data.Dataset.from_tensors((x, x[:, :1] * 2.0)).repeat()

    def model_fn(features, labels, mode):
        hidden = tf.compat.v1.layers.dense(features, 16, activation=tf.nn.relu, name="d1")
        loss = tf.reduce_mean((tf.compat.v1.layers.dense(hidden, 1, name="d2") - labels) ** 2)
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss, tf.compat.v1.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    def estimator(model_dir):
        return tf.estimator.Estimator(model_fn, config=tf.estimator.RunConfig(
            model_dir=str(tmp_path / model_dir), save_checkpoints_steps=None, save_checkpoints_secs=None,
            save_summary_steps=None))

    hook = FlashCheckpointHook(tmp_path / "ck", every_steps=3, job_id=job_id)
    try:
        saved, restored = _Values(at_start=False), _Values(at_start=True)
        estimator("a").train(input_fn, hooks=[hook, saved], max_steps=3)
        estimator("b").train(input_fn, hooks=[hook, restored], steps=1)  # a new model_dir: fresh variables
        assert hook.restored_step == 3
        wrong = sorted(k for k, v in saved.values.items() if not np.array_equal(v, restored.values[k]))
        assert not wrong, wrong
    finally:
        hook.close()
