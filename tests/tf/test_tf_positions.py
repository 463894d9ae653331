"""ShardPositions, the bookkeeping between leased shards and trained records (no TF graph
needed): the crash window between a save and its commit, passes abandoned mid-lease."""

import uuid

import pytest

import sharding
from elastic.tf import ShardPositions


def dataset(size=20, shard_size=5):
    url = f"memory://positions-{uuid.uuid4().hex[:8]}"
    return sharding.connect(url).dataset("d", size=size, shard_size=shard_size)


def test_restore_reapplies_positions_a_kill_kept_from_the_coordinator():
    ds = dataset()
    before = ShardPositions(ds, "w")
    before.deferred, before.batch_size = True, 3
    it = before.shards()
    first, _ = next(it)
    second, _ = next(it)
    before.consumed_steps(3)  # 9 records: shard 0 done, shard 1 at 4 of 5
    saved = before.state()
    # killed after the checkpoint, before commit(): the coordinator knows nothing
    assert ds.progress()["done"] == 0
    after = ShardPositions(ds, "w")  # the restarted worker, same name
    after.restore(saved)
    assert ds.progress()["done"] == 1 and ds.progress()["leased"] == 0
    resumed = [(shard.index, position) for shard, position in after.shards()]
    assert resumed[0] == (second.index, 4)  # back at the saved position, taken back first
    assert [index for index, _ in resumed] == [1, 2, 3]


def killed_after_a_checkpoint(worker):
    """A data set and the positions ``worker`` saved: shard 0 trained, shard 1 at 1 of 5."""
    ds = dataset()
    before = ShardPositions(ds, worker)
    before.deferred, before.batch_size = True, 3
    it = before.shards()
    next(it), next(it)
    before.consumed_steps(2)
    return ds, before.state()


def test_a_worker_named_by_default_takes_the_name_of_its_checkpoint_and_its_leases_back():
    ds, saved = killed_after_a_checkpoint("host-pid1")  # the default name of the killed process
    restarted = ShardPositions(ds)  # a new pid: a new default name
    assert restarted.worker != "host-pid1"
    restarted.restore(saved)
    assert restarted.worker == "host-pid1"
    assert ds.progress()["leased"] == 0  # taken back now, not after the lease timeout
    resumed = [(shard.index, position) for shard, position in restarted.shards()]
    assert resumed == [(1, 1), (2, 0), (3, 0)]


def test_a_worker_name_the_user_gave_stays_after_a_restore():
    ds, saved = killed_after_a_checkpoint("host-pid1")
    named = ShardPositions(ds, "given")
    named.restore(saved)
    assert named.worker == "given"
    assert ds.progress()["leased"] == 1  # shard 1 stays leased to host-pid1 until its lease expires


def test_a_shard_leased_for_an_abandoned_pass_is_read_by_the_next():
    ds = dataset()
    positions = ShardPositions(ds, "w")
    positions.batch_size = 5
    old = positions.shards()
    assert next(old)[0].index == 0
    new = positions.shards()  # a new pass starts (the old iterator still runs ahead)
    assert next(new)[0].index == 0  # replayed: handed out, never trained
    assert next(old, None) is None  # the old pass leases shard 1, then sees it is stale
    got = [shard.index for shard, _ in new]
    assert got == [1, 2, 3]  # shard 1 comes from the stranded lease, not lost
    positions.consumed_steps(4)
    assert ds.progress()["finished"]


def test_a_short_last_batch_completes_without_over_consumption(caplog):
    ds = dataset(size=7, shard_size=5)
    positions = ShardPositions(ds, "w")
    positions.batch_size = 4
    list(positions.shards())
    positions.consumed_steps(2)  # 4 + 3 records
    assert ds.progress()["finished"]
    assert "beyond the shards" not in caplog.text
    positions.consumed_steps(1)  # nothing handed out: the reader yielded more than the shards hold
    assert "beyond the shards" in caplog.text


class CountingDataset:
    """A sharding.Dataset that counts the coordinator calls made through it."""

    def __init__(self, inner):
        self._inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name in ("acquire", "complete", "complete_and_acquire", "complete_and_acquire_many", "report"):
            def counted(*args, **kwargs):
                self.calls.append(name)
                return attr(*args, **kwargs)
            return counted
        return attr


@pytest.mark.parametrize("batch, calls", [(1, 9), (3, 4), (8, 2)])
def test_each_lease_carries_the_completion_of_the_finished_shards_in_one_round_trip(batch, calls):
    ds = CountingDataset(dataset(size=40, shard_size=5))
    positions = ShardPositions(ds, "w")
    positions.batch_size = 5
    handed = []
    for shard, _ in positions.shards(batch):  # the step trains each shard before the next is read
        handed.append(shard.index)
        positions.consumed_steps(1)
        assert ds.progress()["workers"]["w"]["leased"] <= batch
    assert handed == list(range(8))
    assert ds.progress()["finished"]
    # one round trip per `batch` shards, each completing the ones before (the last learns the end)
    assert ds.calls == ["complete_and_acquire_many"] * calls


def test_finished_shards_complete_before_close_gives_the_leases_back():
    ds = dataset()
    positions = ShardPositions(ds, "w")
    positions.batch_size = 3
    it = positions.shards()
    next(it), next(it)  # shards 0 and 1 handed out; the pass goes on
    positions.consumed_steps(2)  # shard 0 done, shard 1 at 1 of 5: nothing sent yet
    assert ds.progress()["done"] == 0
    positions.close()
    progress = ds.progress()
    assert progress["done"] == 1 and progress["leased"] == 0  # shard 1 back in the queue ...
    again = ShardPositions(ds, "v")
    assert [(s.index, s.consumed) for s, _ in again.shards()][0] == (1, 0)  # ... at its committed position
