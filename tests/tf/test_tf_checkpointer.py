"""flashckpt.tf.Checkpointer in one process: one-copy save, in-place load from memory and
from storage, export to a stock TF checkpoint, data positions inside the checkpoint."""

import glob
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

import elastic.tf as etf
from flashckpt import CheckpointError, _events
from flashckpt.tf import Checkpointer
from flashckpt.tf import _variables

from ._models import dense_model, same, values
from flashckpt._names import job_prefix


@pytest.fixture
def loads():
    seen = []

    def listen(event, **info):
        if event == "load":
            seen.append(info)

    _events.subscribe(listen)
    yield seen
    _events.unsubscribe(listen)


def test_import_flashckpt_elastic_sharding_never_imports_tensorflow():
    code = ("import sys, flashckpt, elastic, sharding, flashckpt._engine; "
            "bad = [m for m in ('tensorflow', 'keras', 'tensorflow_estimator') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_save_reads_each_variable_through_a_view_of_its_own_buffer():
    model = dense_model()
    for var in model.variables:
        view = _variables.read_alias(var)
        if var.shape.rank:  # the copy into shared memory is the only copy
            assert view.ctypes.data == var.value()._numpy().ctypes.data
            assert _variables.writable_alias(var) is not None


@pytest.mark.parametrize("memory_slots", [2, 1])
def test_load_in_place_from_memory_then_from_storage(tmp_path, job_id, loads, memory_slots):
    model = dense_model()
    saved = values(model)
    with Checkpointer(tmp_path, model, job_id=job_id, memory_slots=memory_slots) as ckpt:
        ckpt.save(7)
        ckpt.save(7)  # a second save fills the other slot, where there is one
        slots = glob.glob(job_prefix(job_id) + ".rank0.slot*")
        assert len(slots) == memory_slots, slots
        buffers = [v.value()._numpy().ctypes.data for v in model.variables if v.shape.rank]
        model.fit(np.ones((8, 4)), np.zeros((8, 1)), verbose=0)
        assert not same(values(model), saved)
        assert ckpt.load() == 7
        assert loads[-1]["source"] == "memory"
        assert same(values(model), saved)
        # written into the variables' own buffers where TF had them before the load
        after = [v.value()._numpy().ctypes.data for v in model.variables if v.shape.rank]
        assert len(set(after) & set(buffers)) >= 1
    fresh = dense_model(trained=False, seed=1)  # optimizer slots not built yet
    with Checkpointer(tmp_path, fresh, job_id=job_id) as ckpt:
        assert ckpt.load() == 7
        assert loads[-1]["source"] == "storage"
        assert same(values(fresh), saved)


def test_export_restores_with_plain_tf_train_checkpoint(tmp_path, job_id):
    model = dense_model()
    saved = values(model)
    with Checkpointer(tmp_path / "flash", model, job_id=job_id) as ckpt:
        ckpt.save(3)
        prefix = ckpt.export(tmp_path / "stock" / "ckpt")
        ckpt.save(4, export=True)  # the saver process writes step-4/tf/ckpt after the commit
        ckpt.wait()
    other = dense_model(trained=False, seed=2)
    other.optimizer.build(other.trainable_variables)
    status = tf.train.Checkpoint(model=other, optimizer=other.optimizer).restore(prefix)
    status.assert_consumed()
    assert same(values(other), saved)
    assert tf.train.latest_checkpoint(tmp_path / "stock").endswith("ckpt")
    by_saver = tf.train.latest_checkpoint(tmp_path / "flash" / "step-4" / "tf")
    third = dense_model(trained=False, seed=3)
    third.optimizer.build(third.trainable_variables)
    tf.train.Checkpoint(model=third, optimizer=third.optimizer).restore(by_saver).assert_consumed()
    assert same(values(third), saved)


def test_data_positions_roll_back_with_the_model(tmp_path, job_id):
    n = 40
    shards = etf.ShardDataset(f"sqlite:///{tmp_path}/c.db", "d", size=n, shard_size=6, worker="w")
    shards.positions.batch_size = 4
    model = dense_model()
    ckpt = Checkpointer(tmp_path / "ck", model, data=shards, job_id=job_id, rollback=etf.Rollback.DATASET)
    trained = []
    batches = iter(shards.flat_map(lambda s: tf.data.Dataset.from_tensor_slices(s.indices)).batch(4))
    for _ in range(3):
        trained += next(batches).numpy().tolist()
        shards.positions.consumed_steps(1)
    ckpt.save(3)
    at_save = list(trained)
    for _ in range(4):  # trained after the save: rolled back with the model
        trained += next(batches).numpy().tolist()
        shards.positions.consumed_steps(1)
    del batches
    assert ckpt.load() == 3
    rest = []
    for batch in shards.flat_map(lambda s: tf.data.Dataset.from_tensor_slices(s.indices)).batch(4):
        rest += batch.numpy().tolist()
        shards.positions.consumed_steps(1)
    ckpt.save(4)
    assert sorted(at_save + rest) == list(range(n))
    assert shards.positions.dataset.progress()["finished"]
    ckpt.close()


def test_bfloat16_variables_round_trip_in_place_and_export_as_bfloat16(tmp_path, job_id):
    def state(seed):
        rng = np.random.default_rng(seed)
        return {"w": tf.Variable(tf.cast(rng.standard_normal((5, 3)), tf.bfloat16)),
                "b": tf.Variable(tf.cast(rng.standard_normal(3), tf.bfloat16)),
                "f": tf.Variable(rng.standard_normal(4).astype(np.float32))}

    saved = state(0)
    expected = {k: v.numpy().copy() for k, v in saved.items()}
    with Checkpointer(tmp_path / "flash", dict(saved), job_id=job_id) as ckpt:
        ckpt.save(1)
        saved["w"].assign(tf.zeros([5, 3], tf.bfloat16))
        buffer = saved["w"].value()._numpy().ctypes.data
        assert ckpt.load() == 1
        assert saved["w"].value()._numpy().ctypes.data == buffer  # in place
        assert all(np.array_equal(saved[k].numpy(), expected[k]) for k in expected)
        prefix = ckpt.export(tmp_path / "stock" / "ckpt")
    fresh = state(1)
    with Checkpointer(tmp_path / "flash", dict(fresh), job_id=job_id) as ckpt:
        assert ckpt.load() == 1  # from storage
    assert all(fresh[k].dtype == saved[k].dtype and np.array_equal(fresh[k].numpy(), expected[k]) for k in expected)
    stock = state(2)
    tf.train.Checkpoint(**stock).restore(prefix).assert_consumed()
    assert all(np.array_equal(stock[k].numpy(), expected[k]) for k in expected)
    as_uint16 = {"w": tf.Variable(tf.zeros([5, 3], tf.uint16)), "b": saved["b"], "f": saved["f"]}  # the same bytes
    with Checkpointer(tmp_path / "flash", as_uint16, job_id=job_id) as ckpt:
        with pytest.raises(CheckpointError, match="bfloat16 here and not in the checkpoint.*: w"):
            ckpt.load()


def test_string_variables_and_lookup_tables_are_refused_by_name(tmp_path, job_id):
    with Checkpointer(tmp_path, {"s": tf.Variable("text")}, job_id=job_id) as ckpt:
        with pytest.raises(CheckpointError, match="string variables"):
            ckpt.save(1)
    table = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, default_value=-1)
    with Checkpointer(tmp_path / "t", {"table": table}, job_id=job_id) as ckpt:
        with pytest.raises(CheckpointError, match="not variables"):
            ckpt.save(1)


def test_background_save_keeps_the_values_of_its_step_while_training_goes_on(tmp_path, job_id):
    n = 24
    shards = etf.ShardDataset(f"sqlite:///{tmp_path}/c.db", "d", size=n, shard_size=4, worker="w")
    shards.positions.batch_size = 4
    model = dense_model()
    batches = iter(shards.flat_map(lambda s: tf.data.Dataset.from_tensor_slices(s.indices)).batch(4))
    trained = []
    with Checkpointer(tmp_path / "ck", model, data=shards, background=True, job_id=job_id) as ckpt:
        for _ in range(2):
            trained += next(batches).numpy().tolist()
            shards.positions.consumed_steps(1)
        saved = values(model)
        gate, engine_save = threading.Event(), ckpt._engine.save
        ckpt._engine.save = lambda *a, **k: (gate.wait(30), engine_save(*a, **k))[1]
        ckpt.save(2)  # returns at once; the copy waits for the gate
        model.fit(np.ones((8, 4)), np.zeros((8, 1)), verbose=0)  # updates first: TF copies on write
        for _ in range(2):
            trained += next(batches).numpy().tolist()
            shards.positions.consumed_steps(1)
        gate.set()
        ckpt.wait()
        del ckpt._engine.save
        assert shards.positions.dataset.progress()["done"] == 2  # what step 2 held, not what came after
        assert not same(values(model), saved)
        assert ckpt.load() == 2
        assert same(values(model), saved)
        ckpt._engine.save = lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone"))
        ckpt.save(3)  # the failure comes out of the next call
        with pytest.raises(OSError, match="disk gone"):
            ckpt.wait()
        del ckpt._engine.save
    del batches


def test_variables_sharing_one_buffer_load_their_own_values(tmp_path, job_id, loads):
    """TF backs a variable assigned (or made) from another with that one's buffer until one
    is written, as Keras' EMA copies and freshly initialised variables can be: a load must
    not write both through the one buffer (each got the other's value from memory, and
    storage saw a checksum mismatch and called a sound shard corrupt)."""
    a = tf.Variable(tf.random.stateless_normal((4, 4), seed=(1, 2)))
    b = tf.Variable(tf.random.stateless_normal((4, 4), seed=(3, 4)))
    root = tf.train.Checkpoint(a=a, b=b)
    saved = a.numpy().copy(), b.numpy().copy()
    ckpt = Checkpointer(tmp_path, root, job_id=job_id)
    try:
        ckpt.save(3)
        for source in ("memory", "storage"):
            if source == "storage":
                ckpt.close()
                ckpt = Checkpointer(tmp_path, root, job_id=job_id)
            b.assign(a)
            assert a.value()._numpy().ctypes.data == b.value()._numpy().ctypes.data  # one buffer now
            assert ckpt.load() == 3 and loads[-1]["source"] == source
            assert np.array_equal(a.numpy(), saved[0]) and np.array_equal(b.numpy(), saved[1]), source
    finally:
        ckpt.close()


def _gan(seed):
    """Two models, each with an optimizer of its own (TF's DCGAN tutorial's checkpoint)."""
    tf.keras.utils.set_random_seed(seed)
    gen = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(3)])
    disc = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    gen_opt, disc_opt = tf.keras.optimizers.Adam(0.01), tf.keras.optimizers.Adam(0.02)
    root = tf.train.Checkpoint(generator=gen, discriminator=disc, generator_optimizer=gen_opt,
                               discriminator_optimizer=disc_opt)
    return root, gen, disc, gen_opt, disc_opt


def test_optimizers_of_several_models_are_not_guessed_and_load_once_built(tmp_path, job_id):
    root, gen, disc, gen_opt, disc_opt = _gan(0)
    for model, opt in ((gen, gen_opt), (disc, disc_opt)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones((2, model.inputs[0].shape[1]))) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    saved = [v.numpy().copy() for v in gen.variables + disc.variables + gen_opt.variables + disc_opt.variables]
    with Checkpointer(tmp_path, root, job_id=job_id) as ckpt:
        ckpt.save(1)
    fresh, gen2, disc2, gen_opt2, disc_opt2 = _gan(1)  # a restart: optimizers without slots yet
    with Checkpointer(tmp_path, fresh, job_id=job_id) as ckpt:
        with pytest.raises(CheckpointError, match=r"generator_optimizer.*optimizer\.build"):
            ckpt.load()
        gen_opt2.build(gen2.trainable_variables)
        disc_opt2.build(disc2.trainable_variables)
        assert ckpt.load() == 1
    loaded = [v.numpy() for v in gen2.variables + disc2.variables + gen_opt2.variables + disc_opt2.variables]
    assert len(loaded) == len(saved) and all(np.array_equal(a, b) for a, b in zip(saved, loaded))
