"""ElasticDistributedSampler: one process, and real gloo groups changing world size."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import elastic
from elastic import CountingLoader, ElasticDistributedSampler
from elastic import _progress

from tests._fork import run_ranks
from ._workers import IndexDataset, train_elastic

N = 1001  # odd: every world size below pads


# -- one process ------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_fresh_epoch_matches_distributed_sampler_layout(world, drop_last):
    ds = IndexDataset(N)
    for rank in range(world):
        ours = ElasticDistributedSampler(ds, world, rank, shuffle=False, drop_last=drop_last)
        ref = DistributedSampler(ds, world, rank, shuffle=False, drop_last=drop_last)
        assert list(ours) == list(ref) and len(ours) == len(ref)


def test_defaults_without_process_group():
    s = ElasticDistributedSampler(IndexDataset(10))
    assert (s.num_replicas, s.rank) == (1, 0)
    assert sorted(s) == list(range(10))


def take(sampler, k):
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def test_set_epoch_keeps_restored_position_and_new_epoch_starts_over():
    ds = IndexDataset(100)
    a = ElasticDistributedSampler(ds, 2, 0, seed=3)
    a.set_epoch(4)
    first = take(a, 10)
    state = a.state_dict()
    b = ElasticDistributedSampler(ds, 2, 0, seed=3)
    b.load_state_dict(state)
    b.set_epoch(4)  # what every loop does on resume
    assert len(b) == 40
    rest = list(b)
    full = ElasticDistributedSampler(ds, 2, 0, seed=3)
    full.set_epoch(4)
    assert first + rest == list(full)
    b.set_epoch(5)
    assert len(list(b)) == 50  # a new epoch is whole
    assert len(list(b)) == 50  # iterating again without set_epoch: the same epoch again


def test_abandoned_iteration_restarts_like_distributed_sampler():
    s = ElasticDistributedSampler(IndexDataset(20), 1, 0)
    peek = take(s, 3)
    assert list(s)[:3] == peek and len(list(s)) == 20


def test_state_after_finished_epoch_resumes_empty():
    s = ElasticDistributedSampler(IndexDataset(20), 2, 1)
    list(s)
    t = ElasticDistributedSampler(IndexDataset(20), 3, 2)
    t.load_state_dict(s.state_dict())
    t.set_epoch(0)
    assert list(t) == [] and len(t) == 0


# -- consumed, not prefetched --------------------------------------------------------
@pytest.mark.parametrize("how", ["wrapper", "argument"])
def test_prefetching_loader_counts_only_what_the_loop_received(how):
    ds = IndexDataset(200)
    s = ElasticDistributedSampler(ds, 1, 0, seed=1)
    loader = DataLoader(ds, batch_size=4, sampler=s, num_workers=2, prefetch_factor=4)
    got = []
    if how == "wrapper":
        it = iter(CountingLoader(loader))
    else:
        it = iter(loader)
    for _ in range(5):
        got += next(it).tolist()
    assert s._yielded > len(got), "the loader should have prefetched past the loop"
    state = s.state_dict() if how == "wrapper" else s.state_dict(consumed=len(got))
    if how == "argument":
        # the naive state (what the sampler yielded) skips the prefetched samples
        naive = s.state_dict()
        assert naive["segments"][-1]["consumed"] > len(got)
    del it
    r = ElasticDistributedSampler(ds, 1, 0, seed=1)
    r.load_state_dict(state)
    r.set_epoch(0)
    rest = [int(b) for batch in DataLoader(ds, batch_size=4, sampler=r, num_workers=2) for b in batch]
    assert sorted(got + rest) == list(range(200))


def test_counting_loader_whole_epoch_and_consumed_too_large():
    ds = IndexDataset(30)
    s = ElasticDistributedSampler(ds, 1, 0)
    seen = [int(i) for b in CountingLoader(DataLoader(ds, batch_size=4, sampler=s, num_workers=1)) for i in b]
    assert sorted(seen) == list(range(30))
    assert s.state_dict()["segments"][-1]["consumed"] == 30
    with pytest.raises(ValueError, match="exceeds"):
        s.state_dict(consumed=31)
    with pytest.raises(TypeError, match="ElasticDistributedSampler or ShardSampler"):
        CountingLoader(DataLoader(ds, batch_size=4))


# -- bad input ------------------------------------------------------------------------
def test_bad_arguments_get_clear_errors():
    ds = IndexDataset(10)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        ElasticDistributedSampler(ds, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        ElasticDistributedSampler(ds, num_replicas=2, rank=-1)
    with pytest.raises(ValueError, match=r"rank must lie in \[0, 1\]"):
        ElasticDistributedSampler(ds, num_replicas=2, rank=2)
    with pytest.raises(TypeError, match="num_replicas must be an int"):
        ElasticDistributedSampler(ds, num_replicas=2.0, rank=0)
    with pytest.raises(TypeError, match="must have a length"):
        ElasticDistributedSampler(iter([1]), 1, 0)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        ElasticDistributedSampler(ds, 1, 0).set_epoch(-1)


def test_bad_state_gets_clear_errors():
    s = ElasticDistributedSampler(IndexDataset(10), 2, 0, seed=1)
    take(s, 2)
    state = s.state_dict()
    with pytest.raises(ValueError, match="dataset_len=10 but this sampler has dataset_len=11"):
        ElasticDistributedSampler(IndexDataset(11), 2, 0, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1 but this sampler has seed=2"):
        ElasticDistributedSampler(IndexDataset(10), 2, 0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        ElasticDistributedSampler(IndexDataset(10), 2, 0, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="not an ElasticDistributedSampler state"):
        s.load_state_dict({"epoch": 0})
    bad = dict(state, segments=[{"num_replicas": 2, "consumed": 6}])
    with pytest.raises(ValueError, match=r"\[0, 5\]"):
        s.load_state_dict(bad)
    with pytest.raises(ValueError, match="malformed"):
        s.load_state_dict(dict(state, segments=[{"num_replicas": 2}]))
    with pytest.raises(ValueError, match="segment num_replicas must be >= 1"):
        s.load_state_dict(dict(state, segments=[{"num_replicas": 0, "consumed": 0}]))


# -- the agent --------------------------------------------------------------------------
def test_sampler_ticks_a_running_agent(monkeypatch):
    ticks = []

    class FakeAgent:
        def tick(self):
            ticks.append(1)

    monkeypatch.setattr(_progress, "_lookup", lambda: FakeAgent())
    monkeypatch.setattr(_progress, "_last_tick", -1e9)
    list(ElasticDistributedSampler(IndexDataset(5), 1, 0))
    assert ticks  # rate-limited: at least the first sample ticks


def test_import_elastic_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, elastic; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


# -- real process groups, world size change -----------------------------------------
def check_exactly_once(parts, padding):
    counts = Counter(i for part in parts for i in part)
    missing = set(range(N)) - set(counts)
    assert not missing, f"{len(missing)} samples never trained, e.g. {sorted(missing)[:5]}"
    repeats = sum(c - 1 for c in counts.values())
    assert repeats == padding, f"{repeats} samples trained twice, padding accounts for {padding}"


@pytest.fixture(scope="module")
def first_part():
    """Two gloo ranks train 30 batches of 8 of epoch 0, then checkpoint."""
    res = run_ranks(train_elastic, 2, N, 8, 30, None)
    assert res[0]["state"] == res[1]["state"], "ranks must save the same sampler state"
    return res


@pytest.mark.parametrize("new_world", [3, 1])
def test_world_size_change_trains_each_sample_once(first_part, new_world):
    state = first_part[1]["state"]  # any rank's copy
    after = run_ranks(train_elastic, new_world, N, 8, None, state)
    parts = [r["seen"] for r in first_part] + [r["seen"] for r in after]
    check_exactly_once(parts, after[0]["padding"])
    if new_world == 3:
        assert after[0]["padding"] == 1  # 1001 - 480 = 521 samples over 3 ranks


def test_two_changes_with_per_rank_counts(first_part):
    """2 -> 3 (10 batches, counts gathered) -> 2 with a prefetching loader -> 1."""
    mid = run_ranks(train_elastic, 3, N, 8, 10, first_part[0]["state"], True)
    late = run_ranks(train_elastic, 2, N, 4, 7, mid[2]["state"], False, 2)
    end = run_ranks(train_elastic, 1, N, 8, None, late[0]["state"])
    parts = [r["seen"] for run in (first_part, mid, late, end) for r in run]
    assert len(end[0]["state"]["segments"]) == 4
    check_exactly_once(parts, end[0]["padding"])


def test_samplers_tick_the_real_agent(tmp_path):
    """With ``elastic.start_agent()`` running, both samplers call ``agent.tick()``.
    In a subprocess: the agent installs process-wide handlers."""
    import subprocess
    import sys

    code = f"""
import elastic
agent = elastic.start_agent(metrics_dir={str(tmp_path / "metrics")!r})
calls = []
real_tick = agent.tick
agent.tick = lambda: (calls.append(1), real_tick())[1]
from elastic import _progress, ElasticDistributedSampler, ShardSampler
_progress._last_tick = -1e9
list(ElasticDistributedSampler(range(10), 1, 0))
_progress._last_tick = -1e9
list(ShardSampler(10, coordinator="memory://tick", name="t", shard_size=4, worker="w"))
agent.stop()
print(len(calls))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "2", out.stdout + out.stderr[-2000:]
