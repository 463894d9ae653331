"""Sample order of an elastic, resumable static partition — pure functions.

An epoch's order is a permutation of ``range(n)`` fixed by ``(seed, epoch)``. Within an
epoch, training runs in *segments*: one segment per world size the epoch was trained
with (a restart with another world size begins a new segment). A segment partitions
the samples not yet consumed, ``remaining``, like ``torch.utils.data.DistributedSampler``
does: pad to a multiple of the world size (or truncate, with ``drop_last``), then rank
``r`` takes positions ``r, r + W, r + 2W, ...``. Rank ``r`` having consumed ``c[r]`` of
its list means positions ``r + W*j`` for ``j < c[r]`` are consumed.

So the whole resume state is ``(n, seed, epoch, shuffle, drop_last)`` plus the list of
segments ``(W, c)``; ``c`` is one number when every rank consumed the same count (the
case of a DDP loop that takes one batch per step on every rank), else one per rank.
Everything here is numpy only, so it can be tested with thousands of simulated ranks.

Trade-off: re-partitioning on a world-size change moves samples between ranks (as any
static partition must); padding of a cut-short segment is counted, never silently added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

__all__ = [
    "Segment",
    "Plan",
    "epoch_order",
    "plan_segment",
    "consumed_mask",
    "remaining_after",
    "rank_indices",
]

Consumed = Union[int, Sequence[int]]


@dataclass(frozen=True, slots=True)
class Segment:
    """Part of an epoch trained with one world size.

    ``consumed`` is the number of samples each rank consumed from its list: one int for
    all ranks, or a sequence with one entry per rank.
    """

    num_replicas: int
    consumed: Consumed

    def counts(self) -> np.ndarray:
        """Per-rank consumed counts as an int64 array of length ``num_replicas``."""
        if isinstance(self.consumed, (int, np.integer)):
            return np.full(self.num_replicas, int(self.consumed), dtype=np.int64)
        counts = np.asarray(self.consumed, dtype=np.int64)
        if counts.shape != (self.num_replicas,):
            raise ValueError(
                f"segment consumed counts have {counts.size} entries, expected one per rank "
                f"({self.num_replicas})"
            )
        return counts


@dataclass(frozen=True, slots=True)
class Plan:
    """One segment's layout: ``positions`` are indices into ``remaining`` (length
    ``num_samples * num_replicas``); ``padding`` repeats, ``dropped`` left out."""

    positions: np.ndarray
    num_replicas: int
    num_samples: int
    padding: int
    dropped: int


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of ``range(n)`` for ``epoch``: a permutation fixed by ``(seed, epoch)``."""
    if n < 0:
        raise ValueError(f"data set length must be >= 0, got {n}")
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([int(seed) & 0xFFFFFFFFFFFFFFFF, int(epoch)]))
    return rng.permutation(n).astype(np.int64, copy=False)


def plan_segment(num_remaining: int, num_replicas: int, drop_last: bool) -> Plan:
    """Lay out ``num_remaining`` samples over ``num_replicas`` ranks.

    Without ``drop_last`` the list is padded by repeating its head (wrapping around when
    there are fewer samples than ranks); with it, the tail is cut to a multiple of the
    world size.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if drop_last:
        per_rank = num_remaining // num_replicas
    else:
        per_rank = -(-num_remaining // num_replicas)
    total = per_rank * num_replicas
    if num_remaining == 0:
        positions = np.zeros(0, dtype=np.int64)
    else:
        positions = np.arange(total, dtype=np.int64) % num_remaining
    return Plan(
        positions=positions,
        num_replicas=num_replicas,
        num_samples=per_rank,
        padding=max(0, total - num_remaining),
        dropped=max(0, num_remaining - total),
    )


def consumed_mask(plan: Plan, counts: np.ndarray) -> np.ndarray:
    """Boolean mask over ``plan.positions``: which planned entries were consumed."""
    if np.any(counts < 0) or np.any(counts > plan.num_samples):
        raise ValueError(
            f"consumed counts must lie in [0, {plan.num_samples}] for this segment, "
            f"got min {int(counts.min())} max {int(counts.max())}"
        )
    w = plan.num_replicas
    p = np.arange(plan.positions.size, dtype=np.int64)
    return (p // w) < counts[p % w]


def remaining_after(
    order: np.ndarray, segments: Sequence[Segment], drop_last: bool
) -> tuple[np.ndarray, int]:
    """The samples of ``order`` not consumed after ``segments``, in order, and the number
    of padding repeats consumed on the way.

    A sample consumed only through a padding repeat counts as consumed (it was trained
    once); a sample consumed both directly and through padding is one padding repeat.
    """
    remaining = order
    padding_seen = 0
    for seg in segments:
        plan = plan_segment(remaining.size, seg.num_replicas, drop_last)
        mask = consumed_mask(plan, seg.counts())
        hits = np.bincount(plan.positions[mask], minlength=remaining.size)
        padding_seen += int(np.maximum(hits - 1, 0).sum())
        remaining = remaining[hits == 0]
    return remaining, padding_seen


def rank_indices(remaining: np.ndarray, num_replicas: int, rank: int, drop_last: bool) -> np.ndarray:
    """The sample indices rank ``rank`` yields in a segment over ``remaining``."""
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must lie in [0, {num_replicas - 1}], got {rank}")
    plan = plan_segment(remaining.size, num_replicas, drop_last)
    return remaining[plan.positions[rank::num_replicas]]
