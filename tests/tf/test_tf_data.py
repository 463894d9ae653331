"""elastic.tf in one process: records count as consumed when the step takes them, not when
prefetched; an abandoned pass re-yields what was never trained; the estimator input_fn
with ShardReportHook completes every shard; Keras fits until the data set is finished."""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf

import elastic.tf as etf
import sharding
from flashckpt.tf import FlashCheckpointCallback

from ._models import dense_model, linear_model_fn


def read_ids(shard):
    return tf.data.Dataset.from_tensor_slices(shard.indices)


def test_prefetched_records_are_not_completed_and_come_again_in_the_next_pass():
    shards = etf.ShardDataset("memory://tf-prefetch", "d", size=50, shard_size=5, worker="w", num_epochs=2,
                              shuffle=True, seed=3)
    positions = shards.positions
    positions.batch_size = 4
    trained = []
    pipeline = shards.flat_map(read_ids).batch(4).prefetch(8)
    it = iter(pipeline)
    for _ in range(3):
        trained += next(it).numpy().tolist()
        positions.consumed_steps(1)
    next(it), next(it)  # fetched, never trained (what a prefetch buffer holds)
    progress = positions.dataset.progress()
    assert progress["done"] <= 2  # finished shards complete with the producer's next lease ...
    assert progress["leased"] >= 2  # 20 records handed out: shards 3 and 4 leased
    positions.commit()  # ... or at a commit (ShardReportHook.end)
    progress = positions.dataset.progress()
    assert progress["done"] == 2  # 12 records trained: shards of 5 -> two complete, one at 2 of 5
    del it  # abandon the pass with fetched records in flight
    passes = 0
    while not positions.dataset.progress()["finished"]:  # a pass ends at the latest with its epoch
        passes += 1
        for batch in pipeline:
            trained += batch.numpy().tolist()
            positions.consumed_steps(1)
    assert passes == 2
    counts = collections.Counter(trained)
    assert sorted(counts) == list(range(50)) and set(counts.values()) == {2}  # two epochs, each record twice
    assert positions.dataset.progress()["finished"]


def test_uncommitted_positions_stay_with_the_worker_until_a_checkpoint_commits(tmp_path):
    shards = etf.ShardDataset("memory://tf-deferred", "d", size=20, shard_size=5, worker="w")
    positions = shards.positions
    positions.deferred = True  # as under a flash checkpointer
    positions.batch_size = 5
    it = iter(shards.flat_map(read_ids).batch(5))
    next(it)
    positions.consumed_steps(1)
    assert positions.dataset.progress()["done"] == 0  # trained, not yet checkpointed
    state = positions.state()
    positions.commit()
    assert positions.dataset.progress()["done"] == 1
    assert state["leases"] and state["leases"][0][-1] == 5


def test_estimator_input_fn_with_report_hook_completes_every_shard(tmp_path):
    n, batch = 100, 8
    url = f"sqlite:///{tmp_path}/c.db"

    def reader(shard):
        x = tf.cast(shard.indices, tf.float32)[:, None] / n
        return tf.data.Dataset.from_tensor_slices(({"x": x}, 2.0 * x[:, 0]))

    input_fn = etf.make_input_fn(reader, coordinator=url, name="train", size=n, shard_size=10, batch_size=batch,
                                 worker="est-0")
    config = tf.estimator.RunConfig(model_dir=str(tmp_path / "model"), save_checkpoints_steps=1000,
                                    save_summary_steps=None)
    estimator = tf.estimator.Estimator(linear_model_fn, config=config)
    helper = input_fn.positions._leases
    estimator.train(input_fn, hooks=[etf.ShardReportHook()])
    progress = sharding.connect(url).dataset("train").progress()
    assert progress["finished"] and progress["leased"] == 0
    assert progress["workers"]["est-0"]["completed"] == n // 10
    assert estimator.get_variable_value("global_step") == int(np.ceil(n / batch))
    # the round trips ran in the lease helper (it answered its greeting and every lease), never here
    assert isinstance(helper, sharding.LeaseProcess) and helper.pid not in (None, os.getpid()) and helper._ready
    input_fn.positions.close()
    assert helper.pid is None and input_fn.positions._leases is input_fn.positions.dataset


def test_files_data_set_hands_out_file_and_offsets_and_shuffled_indices():
    files = [("/data/a.rec", 7), ("/data/b.rec", 5)]
    shards = etf.ShardDataset("memory://tf-files", "f", files=files, shard_size=4, shuffle=True, seed=1, worker="w")
    got = collections.defaultdict(list)
    for spec in shards:
        assert spec.end - spec.start == spec.indices.shape[0] <= 4
        got[spec.file.numpy().decode()] += spec.indices.numpy().tolist()
    assert {name: sorted(ids) for name, ids in got.items()} == {"/data/a.rec": list(range(7)),
                                                                "/data/b.rec": list(range(5))}
    assert any(ids != sorted(ids) for ids in got.values())  # shuffled within shards
    plain = etf.ShardDataset("memory://tf-files-plain", "f", files=files, shard_size=4, worker="w")
    specs = [(s.file.numpy().decode(), s.start.numpy(), s.end.numpy(), s.indices.numpy().tolist()) for s in plain]
    assert specs[0] == ("/data/a.rec", 0, 4, [0, 1, 2, 3])
    assert ("/data/b.rec", 4, 5, [4]) in specs


class FailingSecondLease:
    """A sharding.Dataset whose second round trip for leases fails (the coordinator went away)."""

    def __init__(self, inner):
        self._inner, self.leases = inner, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def complete_and_acquire_many(self, *args, **kwargs):
        self.leases += 1
        if self.leases == 2:
            raise sharding.CoordinatorUnavailable("coordinator went away")
        return self._inner.complete_and_acquire_many(*args, **kwargs)


def test_a_shard_leased_before_a_coordinator_error_is_still_handed_out():
    inner = sharding.connect("memory://tf-fail-second").dataset("d", size=20, shard_size=5)
    positions = etf.ShardPositions(FailingSecondLease(inner), "w")
    positions.batch_size = 5
    got = []
    with pytest.raises(tf.errors.OpError, match="coordinator went away"):
        for batch in etf.ShardDataset.from_positions(positions).flat_map(read_ids).batch(5):
            got += batch.numpy().tolist()
            positions.consumed_steps(1)
    assert got == list(range(20))  # the crossing's shards, leased before the error, reached the pipeline
    positions.commit()
    assert inner.progress()["done"] == 4


def test_keras_fits_until_the_data_set_is_finished_and_a_rerun_finds_it_finished(tmp_path, job_id):
    n, batch, url = 40, 4, f"sqlite:///{tmp_path}/c.db"

    def reader(shard):
        x = tf.cast(shard.indices, tf.float32)[:, None] * tf.ones([1, 4])
        return tf.data.Dataset.from_tensor_slices((x, tf.ones_like(x[:, :1])))

    model = dense_model()
    shards = etf.ShardDataset(url, "d", size=n, shard_size=8, num_epochs=2, worker="w")
    callback = FlashCheckpointCallback(tmp_path / "ck", every_steps=3, data=shards, batch_size=batch, job_id=job_id)
    fits = 0
    assert not shards.finished()
    while not shards.finished() and fits < 5:  # one pass per fit epoch: it ends at the latest with its epoch
        model.fit(shards.flat_map(reader).batch(batch), verbose=0, callbacks=[callback])
        fits += 1
    assert fits == 2 and callback.step == 2 * n // batch
    callback.close()
    shards.positions.close()
    again = etf.ShardDataset(url, "d", size=n, shard_size=8, num_epochs=2, worker="w")
    assert again.finished()  # a rerun of the finished job trains nothing
    again.positions.close()
