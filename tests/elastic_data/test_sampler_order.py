"""Pure-function tests of the elastic sample order, at simulated scale (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from elastic import _order
from elastic._order import Segment


def torch_style_rank_list(indices: list[int], world: int, rank: int, drop_last: bool) -> list[int]:
    """DistributedSampler's layout, written out as it is in torch (the reference)."""
    n = len(indices)
    if drop_last and n % world:
        num_samples = n // world
    else:
        num_samples = -(-n // world)
    total = num_samples * world
    if not drop_last:
        pad = total - n
        if pad <= n:
            indices = indices + indices[:pad]
        else:
            indices = indices + (indices * -(-pad // max(n, 1)))[:pad]
    else:
        indices = indices[:total]
    return indices[rank:total:world]


@pytest.mark.parametrize("n,world", [(10, 3), (10, 4), (7, 7), (3, 8), (1000, 13), (0, 4), (1, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_fresh_segment_is_the_distributed_sampler_layout(n, world, drop_last):
    order = _order.epoch_order(n, seed=3, epoch=2, shuffle=True)
    for rank in range(world):
        ours = _order.rank_indices(order, world, rank, drop_last).tolist()
        assert ours == torch_style_rank_list(order.tolist(), world, rank, drop_last)


def test_order_is_a_function_of_seed_and_epoch():
    a = _order.epoch_order(10_000, seed=1, epoch=0, shuffle=True)
    assert np.array_equal(a, _order.epoch_order(10_000, seed=1, epoch=0, shuffle=True))
    assert np.array_equal(np.sort(a), np.arange(10_000))
    assert not np.array_equal(a, _order.epoch_order(10_000, seed=1, epoch=1, shuffle=True))
    assert not np.array_equal(a, _order.epoch_order(10_000, seed=2, epoch=0, shuffle=True))
    assert np.array_equal(_order.epoch_order(5, 1, 0, shuffle=False), np.arange(5))


def simulate(n, worlds, drop_last, seed, rng, per_rank=False):
    """Run one epoch through segments with the given world sizes; each segment but the
    last stops at a random point. Collect every consumed sample rank by rank through
    ``rank_indices`` (independently of ``consumed_mask``)."""
    order = _order.epoch_order(n, seed, 0, shuffle=True)
    segments: list[Segment] = []
    seen = []
    for i, world in enumerate(worlds):
        remaining, _ = _order.remaining_after(order, segments, drop_last)
        plan = _order.plan_segment(remaining.size, world, drop_last)
        last = i == len(worlds) - 1
        if last:
            counts = np.full(world, plan.num_samples)
        elif per_rank:
            counts = rng.integers(0, plan.num_samples + 1, size=world)
        else:
            counts = np.full(world, rng.integers(0, plan.num_samples + 1))
        for rank in range(world):
            seen.append(_order.rank_indices(remaining, world, rank, drop_last)[: counts[rank]])
        consumed = int(counts[0]) if np.all(counts == counts[0]) else counts.tolist()
        segments.append(Segment(world, consumed))
    _, padding_before_last = _order.remaining_after(order, segments[:-1], drop_last)
    return np.concatenate(seen), segments, plan, padding_before_last


@pytest.mark.parametrize(
    "n,worlds",
    [
        (100_003, [2048, 3000, 7, 1]),
        (50_000, [1, 4096]),
        (20_011, [3, 2, 1, 5000, 2]),
        (999, [2000, 1]),  # more ranks than samples
    ],
)
@pytest.mark.parametrize("per_rank", [False, True])
def test_every_sample_once_across_world_size_changes(n, worlds, per_rank):
    rng = np.random.default_rng(n + len(worlds))
    seen, segments, last_plan, padding_before = simulate(n, worlds, False, 5, rng, per_rank)
    counts = np.bincount(seen, minlength=n)
    assert counts.min() >= 1, "a sample was skipped"
    # every repeat is padding, and the padding is counted
    repeats = int((counts - 1).sum())
    assert repeats == padding_before + last_plan.padding
    assert last_plan.padding < worlds[-1]


@pytest.mark.parametrize("n,worlds", [(100_003, [2048, 3000, 7]), (10_000, [3, 4096, 2])])
def test_drop_last_never_repeats_and_drops_less_than_a_world(n, worlds):
    rng = np.random.default_rng(7)
    seen, _, last_plan, padding_before = simulate(n, worlds, True, 5, rng, per_rank=True)
    counts = np.bincount(seen, minlength=n)
    assert counts.max() == 1 and padding_before == 0
    assert int((counts == 0).sum()) == last_plan.dropped < worlds[-1]


def test_bad_counts_are_rejected():
    plan = _order.plan_segment(10, 3, drop_last=False)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        _order.consumed_mask(plan, np.array([5, 0, 0]))
    with pytest.raises(ValueError, match="one per rank"):
        Segment(3, [1, 2]).counts()
    with pytest.raises(ValueError, match="num_replicas"):
        _order.plan_segment(10, 0, drop_last=False)
    with pytest.raises(ValueError, match="rank"):
        _order.rank_indices(np.arange(10), 3, -1, drop_last=False)
