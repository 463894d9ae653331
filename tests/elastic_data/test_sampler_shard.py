"""ShardSampler against real coordinators: memory (one process), SQLite (processes)."""

from __future__ import annotations

import itertools
import uuid
from collections import Counter

import pytest
from torch.utils.data import DataLoader

import sharding
from elastic import CountingLoader, ShardSampler

from tests._fork import run_ranks
from ._workers import (IndexDataset, boundary_ranks, epoch_without_a_final_boundary, lockstep_shards, peer_a_step_ahead,
                       peer_dead_inside_its_update, train_shards)


def sqlite_url(tmp_path) -> str:
    """A SQLite coordinator file, created here before the workers start. Workaround:
    processes opening a *new* file at the same moment sometimes fail with "cannot open
    ...: database is locked" (reported to the sharding owner)."""
    url = f"sqlite:///{tmp_path}/shards.db"
    sharding.connect(url).close()
    return url


def mem() -> str:
    return f"memory://{uuid.uuid4().hex}"


def sampler(url, n=100, **kw):
    kw = {"shard_size": 8, "shuffle": True, "seed": 3, "num_epochs": 2, "worker": "w0", **kw}
    return ShardSampler(n, coordinator=url, name="train", **kw)


def test_one_iteration_is_one_epoch_of_every_sample():
    s = sampler(mem())
    first, second = list(s), list(s)
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != second  # reshuffled per epoch
    assert list(s) == []  # num_epochs=2: exhausted


def test_rollback_replays_exactly_what_was_trained_after_the_checkpoint():
    s = sampler(mem(), num_epochs=1)
    it = iter(s)
    before = [next(it) for _ in range(37)]
    state = s.state_dict()
    after = [next(it) for _ in range(20)]  # trained, then the job failed
    s.load_state_dict(state)
    replay = list(s)
    assert set(after) <= set(replay)
    assert Counter(before + replay) == Counter(range(100))


def test_a_restart_without_a_checkpoint_resets_the_data_set_and_trains_every_sample():
    """A job killed before its first checkpoint had completed shards at the coordinator;
    its restart (no checkpoint: reset, as the README's loop does) trains them again."""
    url = mem()
    s = sampler(url, num_epochs=1)
    it = iter(s)
    lost = [next(it) for _ in range(37)]  # four shards completed, then the job died
    assert s.progress()["done"] >= 4
    restarted = sampler(url, num_epochs=1)
    restarted.reset()
    assert Counter(restarted) == Counter(range(100))


def test_state_survives_a_new_sampler_with_another_worker_name():
    url = mem()
    s = sampler(url, num_epochs=1)
    it = iter(s)
    before = [next(it) for _ in range(21)]
    state = s.state_dict()
    t = sampler(url, num_epochs=1, worker="other")
    t.load_state_dict(state)
    assert Counter(before + list(t)) == Counter(range(100))


@pytest.mark.parametrize("counting", [True, False])
def test_prefetching_loader_completes_only_received_shards(counting):
    url = mem()
    ds = IndexDataset(200)
    s = sampler(url, n=200, num_epochs=1)
    loader = DataLoader(ds, batch_size=4, sampler=s, num_workers=2, prefetch_factor=4)
    it = iter(CountingLoader(loader) if counting else loader)
    got = [int(i) for _ in range(5) for i in next(it)]  # the loop received 20 samples
    state = s.state_dict()
    del it
    fresh = sampler(url, n=200, num_epochs=1, worker="w1")
    fresh.load_state_dict(state)
    rest = list(fresh)
    counts = Counter(got + rest)
    if counting:
        assert counts == Counter(range(200))
    else:
        # without the wrapper the prefetched samples count as consumed: they are lost
        missing = set(range(200)) - set(counts)
        assert missing, "DataLoader should have prefetched past the loop"


def test_counting_loader_runs_whole_epochs():
    url = mem()
    s = sampler(url, n=150)
    loader = CountingLoader(DataLoader(IndexDataset(150), batch_size=8, sampler=s, num_workers=2))
    for _ in range(2):
        seen = [int(i) for b in loader for i in b]
        assert Counter(seen) == Counter(range(150))
    assert s.progress()["finished"]


def test_bad_input_gets_clear_errors():
    url = mem()
    s = sampler(url, num_epochs=1)
    next(iter(s))
    state = s.state_dict()
    with pytest.raises(ValueError, match="size=100 in the state but 101 here"):
        ShardSampler(101, coordinator=mem(), name="train", shard_size=8, shuffle=True, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=3 in the state but 4 here"):
        ShardSampler(100, coordinator=mem(), name="train", shard_size=8, shuffle=True, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="not a ShardSampler state"):
        s.load_state_dict({"kind": "ElasticDistributedSampler", "version": 1})
    with pytest.raises(ValueError, match="shard_size must be >= 1"):
        ShardSampler(100, coordinator=mem(), name="x", shard_size=0)
    with pytest.raises(TypeError, match="URL or a sharding.Coordinator"):
        ShardSampler(100, coordinator=42, name="x", shard_size=4)
    with pytest.raises(sharding.CoordinatorError, match="unknown coordinator URL scheme"):
        ShardSampler(100, coordinator="ftp://x", name="x", shard_size=4)
    with pytest.raises(ValueError, match="another definition"):  # the same name, another length
        ShardSampler(99, coordinator=url, name="train", shard_size=8, shuffle=True, seed=3)


# -- processes over SQLite ----------------------------------------------------------------
def test_straggler_takes_fewer_samples_than_its_static_share(tmp_path):
    """Rank 1 is 4x slower per sample. With a static partition it would take half the
    data and the epoch would last N/2 slow samples; here it takes far fewer."""
    n, shard = 1200, 25
    url = sqlite_url(tmp_path)
    res = run_ranks(train_shards, 2, url, n, shard, None, None, [0.002, 0.008])
    fast, slow = len(res[0]["seen"]), len(res[1]["seen"])
    assert Counter(res[0]["seen"] + res[1]["seen"]) == Counter(range(n))
    # epoch length in units of a fast sample: dynamic vs static partition
    dynamic, static = max(fast, 4 * slow), 4 * (n // 2)
    assert slow < 0.35 * n, f"slow rank took {slow} of {n} samples (fast: {fast})"
    assert dynamic < 0.75 * static, f"epoch not shorter: {dynamic} vs {static} sample-times"


def test_checkpoint_with_two_ranks_rollback_with_three(tmp_path):
    """2 ranks train, checkpoint (collective), train on, 'fail'; 3 ranks restore the
    coordinator from the checkpoint and finish: every sample exactly once, counting
    what was trained before the checkpoint and after the restore."""
    n, shard = 600, 16
    url = sqlite_url(tmp_path)
    first = run_ranks(train_shards, 2, url, n, shard, 90, None, None, 40)
    assert first[0]["state"] == first[1]["state"]
    trained_after = set(itertools.chain(*(r["later"] for r in first)))
    rest = run_ranks(train_shards, 3, url, n, shard, None, first[1]["state"])
    before = list(itertools.chain(*(r["seen"] for r in first)))
    replay = list(itertools.chain(*(r["seen"] for r in rest)))
    assert trained_after <= set(replay), "samples trained after the checkpoint were not replayed"
    assert Counter(before + replay) == Counter(range(n))


def test_lockstep_ranks_never_wait_for_each_others_leases(tmp_path):
    """Shards of 10, 10, 10, 5: after the first round one rank gets the short shard and
    runs out while its peer still holds a lease. Waiting for that lease in ``acquire``
    would deadlock against the peer's all-reduce; the rank must end its iteration."""
    url = sqlite_url(tmp_path)
    res = run_ranks(lockstep_shards, 2, url, 35, 10)
    assert Counter(res[0] + res[1]) == Counter(range(35))
    assert sorted(map(len, res)) == [15, 20]


# -- the state as of a step boundary (failure capture) -----------------------------------
def test_boundary_state_is_the_state_of_the_boundary_though_the_loop_went_on():
    """``boundary_state()`` at a boundary equals ``state_dict()`` there, without reporting;
    after the loop drew on (completing the shard it was in, leasing the next), a
    ``state_dict()`` from another thread gives that boundary's state and reports nothing,
    and restoring it replays exactly what was drawn after the boundary."""
    import threading

    url = mem()
    s = sampler(url, num_epochs=1, shuffle=False)
    it = iter(s)
    before = [next(it) for _ in range(13)]  # inside the second shard of 8
    reported = s._ds.state_dict()
    at_boundary = s.boundary_state()
    assert s._ds.state_dict() == reported, "boundary_state reported a position"
    after = [next(it) for _ in range(6)]  # the second shard completed, the third leased
    assert s.progress()["done"] == 2
    got = []
    thread = threading.Thread(target=lambda: got.append(s.state_dict()))
    thread.start()
    thread.join()
    assert got == [at_boundary] and got[0] is not at_boundary
    assert s.state_dict() != at_boundary  # the training thread: reports, as before
    assert reported["queue"] == [[1, 0]]  # the lease of the second shard, never reported
    assert at_boundary["coordinator"] == {**reported, "queue": [[1, 5]]}
    restored = sampler(url, num_epochs=1, shuffle=False, worker="w1")
    restored.load_state_dict(at_boundary)
    rest = list(restored)
    assert rest[:6] == after
    assert Counter(before + rest) == Counter(range(100))


def test_a_load_forgets_the_boundary_state():
    import threading

    s = sampler(mem(), num_epochs=1)
    it = iter(s)
    [next(it) for _ in range(3)]
    s.boundary_state()
    s.reset()
    got = []
    thread = threading.Thread(target=lambda: got.append(s.state_dict()))
    thread.start()
    thread.join()
    assert got[0]["coordinator"]["cursor"] == 0


def test_boundary_state_through_a_prefetching_counting_loader():
    """Two workers prefetching through ``CountingLoader``: the state of step 5's boundary,
    taken after step 6's batch arrived (completing a shard at the coordinator, with more
    leased ahead), restored under a fresh sampler and loader, gives the batches of an
    uninterrupted run from step 6 on."""
    def batches(s, stop=None, at=None):
        loader = CountingLoader(DataLoader(IndexDataset(100), batch_size=4, sampler=s, num_workers=2))
        out = []
        for batch in loader:
            out.append([int(i) for i in batch])
            if at is not None:
                at(len(out))
            if len(out) == stop:
                break
        return out

    reference = batches(sampler(mem(), num_epochs=1, shard_size=6))
    url = mem()
    s = sampler(url, num_epochs=1, shard_size=6)
    kept = {}
    drawn = batches(s, stop=6, at=lambda step: kept.update({step: s.boundary_state()}) if step == 5 else None)
    assert drawn == reference[:6]
    assert s.progress()["done"] >= 4  # step 6's batch completed the fourth shard (24 samples)
    restored = sampler(url, num_epochs=1, shard_size=6, worker="w1")
    restored.load_state_dict(kept[5])
    assert batches(restored) == reference[5:]


def test_boundary_state_of_lockstep_ranks_holds_every_ranks_boundary(tmp_path):
    """Under torch.distributed each rank reports its positions at its boundary and completes
    no shard it finished receiving after it: a capture's ``state_dict()`` (another thread)
    after both ranks drew the next step is the state of both boundaries, so restoring it
    replays exactly what was drawn after them. A capture on the training thread while that
    thread is inside a call into the store (a signal handled there; the store's lock held)
    gets an error within its bound, not a deadlock; one before any boundary, on one rank,
    makes no barrier."""
    url = sqlite_url(tmp_path)
    ranks = run_ranks(boundary_ranks, 2, url)
    assert ranks[0]["state"] == ranks[1]["state"]
    assert all("could not be read within" in r["refused"] for r in ranks), ranks
    assert ranks[1]["alone"] < 2, "a capture's state_dict() waited in a barrier"
    restored = ShardSampler(48, coordinator=url, name="boundary", shard_size=6, num_epochs=1, worker="w9")
    restored.load_state_dict(ranks[0]["state"], sync=False)
    rest = list(restored)
    trained = ranks[0]["trained"] + ranks[1]["trained"]
    assert Counter(trained + rest) == Counter(range(48))
    assert set(ranks[0]["later"] + ranks[1]["later"]) <= set(rest)


@pytest.mark.parametrize("backend,then", [("sqlite", "draws"), ("redis", "draws"), ("sqlite", "saves"),
                                          ("sqlite", "begins an iteration")])
def test_a_capture_takes_a_peer_a_step_ahead_at_the_captured_step(tmp_path, request, backend, then):
    """A rank caught before its update of step 2 captures step 1, while its peer went through
    step 2's boundary (reporting, finishing a shard), maybe into a save, and drew step 3
    (leasing another), or began a new iteration, which completes the shard it finished at once:
    the captured state holds the peer's positions as of step 1, so a restart replays both
    ranks' batches of steps 2 and 3 (before, the peer's batch of step 2 was skipped; with the
    save, until a save's report kept to the step tags too; with the new iteration, until the
    completion was tagged with its step)."""
    url = sqlite_url(tmp_path) if backend == "sqlite" else request.getfixturevalue("redis_url")
    ranks = run_ranks(peer_a_step_ahead, 2, url, then)
    restored = ShardSampler(48, coordinator=url, name="ahead", shard_size=6, num_epochs=1, worker="w9")
    restored.load_state_dict(ranks[0]["state"], sync=False)
    rest = list(restored)
    assert Counter(ranks[0]["step1"] + ranks[1]["step1"] + rest) == Counter(range(48))
    assert set(ranks[0]["later"] + ranks[1]["later"]) <= set(rest)


@pytest.mark.parametrize("dies_at", [2, 1])
def test_a_capture_takes_a_peer_dead_inside_its_update_at_the_captured_step(tmp_path, dies_at):
    """Under failure capture each rank reports its positions as its optimizer update begins:
    a peer killed inside its update of step 2 (never reaching its boundary), or of its first
    step (no boundary yet: the sampler reports as of its first iteration), is at that step in
    rank 0's capture of it, so a restart replays exactly what neither trained (before, the
    peer's batch of that step was trained again)."""
    url = sqlite_url(tmp_path)
    ranks = run_ranks(peer_dead_inside_its_update, 2, url, dies_at)
    restored = ShardSampler(48, coordinator=url, name="behind", shard_size=6, num_epochs=1, worker="w9")
    restored.load_state_dict(ranks[0]["state"], sync=False)
    assert Counter(ranks[0]["trained"] + ranks[1]["trained"] + list(restored)) == Counter(range(48))


def test_an_iteration_after_one_that_ended_without_a_boundary_still_draws(tmp_path):
    """Under torch.distributed with boundaries, a rank completes a shard it finished receiving
    only at its next boundary. A loop that ends an epoch without an update after its last
    batch (gradient accumulation, a skipped short batch) takes no boundary there: the next
    iteration must still complete what was received and go on into the next epoch (it used
    to hold on to the received shard, end at once, and never draw again)."""
    assert run_ranks(epoch_without_a_final_boundary, 1, sqlite_url(tmp_path)) == [(20, 20)]
