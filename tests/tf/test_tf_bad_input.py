"""Bad input gets a clear error: variables that changed shape, a checkpoint of another
model, a reader that raises (the shard goes back to the queue), foreign data positions."""

import pytest
import tensorflow as tf

import elastic
import elastic.tf as etf
from flashckpt import CheckpointError, StateMismatchError
from flashckpt.tf import Checkpointer, FlashCheckpointCallback

from ._models import dense_model, linear_model_fn, same, values


def test_variables_that_changed_shape_name_the_variable_and_change_nothing(tmp_path, job_id):
    with Checkpointer(tmp_path, dense_model(3), job_id=job_id) as ckpt:
        ckpt.save(1)
    wider = dense_model(5, seed=4)
    before = values(wider)
    with Checkpointer(tmp_path, wider, job_id=job_id) as ckpt:
        with pytest.raises(StateMismatchError, match=r"layer_with_weights-0~1kernel|layer_with_weights-0/kernel") as err:
            ckpt.load()
    assert "F32[4, 3]" in str(err.value) and "F32[4, 5]" in str(err.value)
    assert same(values(wider), before)


def test_checkpoint_of_another_model_lists_the_keys(tmp_path, job_id):
    with Checkpointer(tmp_path, dense_model(3), job_id=job_id) as ckpt:
        ckpt.save(1)
    other = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2), tf.keras.layers.Dense(2),
                                 tf.keras.layers.Dense(1)])
    other.compile(tf.keras.optimizers.SGD(), "mse")
    with Checkpointer(tmp_path, other, job_id=job_id) as ckpt:
        with pytest.raises(StateMismatchError, match="keys differ") as err:
            ckpt.load()
    assert "layer_with_weights-2" in str(err.value)


def test_reader_that_raises_reports_the_shard_and_returns_it_to_the_queue(tmp_path, job_id):
    n, bad = 48, 2
    url = f"sqlite:///{tmp_path}/c.db"

    def reader(fail):
        def read(shard):
            def check(index):
                if fail and int(index) == bad:
                    raise OSError(f"cannot read shard {int(index)}")
                return index

            ok = tf.py_function(check, [shard.index], tf.int64)
            ids = shard.indices + 0 * ok
            return tf.data.Dataset.from_tensor_slices((tf.cast(ids, tf.float32)[:, None] * tf.ones([1, 4]),
                                                       tf.ones_like(ids, tf.float32)))
        return read

    model = dense_model()
    shards = etf.ShardDataset(url, "d", size=n, shard_size=8, worker="w")
    callback = FlashCheckpointCallback(tmp_path / "ck", every_steps=1, data=shards, batch_size=4, job_id=job_id)
    with pytest.raises(etf.ShardReadError, match=r"(?s)shards being read \(.*shard 2 of epoch 0 \(records 16\.\.24\).*went back to the queue.*cannot read shard 2"):
        model.fit(shards.flat_map(reader(True)).batch(4), verbose=0, callbacks=[callback])
    progress = shards.positions.dataset.progress()
    assert progress["leased"] == 0 and progress["done"] == 2 and progress["todo"] == 4
    callback.close()
    callback = FlashCheckpointCallback(tmp_path / "ck", every_steps=1, data=shards, batch_size=4, job_id=job_id)
    model.fit(shards.flat_map(reader(False)).batch(4), verbose=0, callbacks=[callback])
    callback.close()
    assert shards.positions.dataset.progress()["finished"]
    assert callback.step == n // 4


def test_positions_of_another_data_set_are_refused(tmp_path, job_id):
    a = etf.ShardDataset("memory://bad-a", "a", size=8, shard_size=4, worker="w")
    b = etf.ShardDataset("memory://bad-b", "b", size=8, shard_size=4, worker="w")
    with Checkpointer(tmp_path, dense_model(), data=a, job_id=job_id) as ckpt:
        ckpt.save(1)
    with Checkpointer(tmp_path, dense_model(), data=b, job_id=job_id) as ckpt:
        with pytest.raises(elastic.ElasticError, match="data set 'a'"):
            ckpt.load()


def test_hook_and_callback_arguments_are_checked(tmp_path, job_id):
    with pytest.raises(ValueError, match="batch_size"):
        FlashCheckpointCallback(tmp_path, data=object())
    with pytest.raises(ValueError, match="every_steps"):
        FlashCheckpointCallback(tmp_path, every_steps=0)
    with pytest.raises(TypeError, match="ShardDataset"):
        Checkpointer(tmp_path, dense_model(), data=object())
    with pytest.raises(ValueError, match="batch_size"):
        etf.make_input_fn(lambda s: None, coordinator="memory://x", name="d", size=4, shard_size=2, batch_size=0)
    with pytest.raises(CheckpointError, match="nothing to export"):
        with Checkpointer(tmp_path / "empty", dense_model(), job_id=job_id) as c:
            c.export(tmp_path / "x")


def test_estimator_read_error_comes_out_of_train_and_fail_gives_the_shards_back(tmp_path):
    n, bad = 48, 2
    url = f"sqlite:///{tmp_path}/c.db"

    def reader(shard):
        def check(index):
            if int(index) == bad:
                raise OSError(f"cannot read shard {int(index)}")
            return index

        ids = shard.indices + 0 * tf.py_function(check, [shard.index], tf.int64)
        x = tf.cast(ids, tf.float32)[:, None]
        return tf.data.Dataset.from_tensor_slices(({"x": x}, tf.ones_like(x[:, 0])))

    input_fn = etf.make_input_fn(reader, coordinator=url, name="train", size=n, shard_size=8, batch_size=4, worker="w")
    estimator = tf.estimator.Estimator(linear_model_fn, config=tf.estimator.RunConfig(
        model_dir=str(tmp_path / "model"), save_checkpoints_steps=None, save_checkpoints_secs=None))
    with pytest.raises(tf.errors.OpError, match="cannot read shard 2"):
        estimator.train(input_fn, hooks=[etf.ShardReportHook()])
    assert input_fn.positions.dataset.progress()["leased"] > 0  # still this worker's
    error = input_fn.positions.fail(OSError("cannot read shard 2"))
    assert isinstance(error, etf.ShardReadError) and "shard 2 of epoch 0" in str(error)
    progress = input_fn.positions.dataset.progress()
    assert progress["leased"] == 0 and progress["done"] == 2 and progress["todo"] == 4
    input_fn.positions.close()


def test_save_on_failure_is_refused_with_the_reason(tmp_path, job_id):
    model = dense_model(3)
    with Checkpointer(tmp_path, model, job_id=job_id) as ckpt:
        with pytest.raises(CheckpointError, match="save_on_failure is not supported.*no step boundary"):
            ckpt.save_on_failure(lambda: None, optimizer=model.optimizer)
        ckpt.save(1)  # the checkpointer is unharmed
