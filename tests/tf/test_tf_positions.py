"""ShardPositions, the bookkeeping between leased shards and trained records (no TF graph
needed): the crash window between a save and its commit, passes abandoned mid-lease."""

import uuid

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
