"""Global boxes of sharded tensors: intersections and the contiguous byte runs to read.

A saved shard is a C-contiguous block of a global tensor, placed at ``offset`` with
``shape`` (prepended axes have extent 1). Loading another layout reads, for every
requested block, its intersection with each saved block; :func:`read_runs` turns an
intersection into as few contiguous runs of the saved bytes as the layouts allow
(one run when the block spans whole trailing dimensions, e.g. tensor-parallel splits
along the first axis). Boxes intersect as the FSDP resharder's pieces do
(:class:`flashckpt._reshard.Piece`). Pure functions, no torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .._reshard import Piece

__all__ = ["Box", "intersect", "read_runs", "volume"]


@dataclass(frozen=True, slots=True)
class Box:
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def volume(shape: tuple[int, ...]) -> int:
    return Piece((), tuple(shape)).numel


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None (the FSDP resharder's rule)."""
    if len(a.offset) != len(b.offset):
        raise ValueError(f"boxes of different rank: {a} and {b}")
    common = Piece(a.offset, a.shape).intersect(Piece(b.offset, b.shape))
    return None if common is None else Box(common.offsets, common.lengths)


def read_runs(saved: Box, part: Box) -> tuple[int, list[int]]:
    """Element runs of ``saved``'s C-order data that hold ``part`` (inside ``saved``).

    Returns ``(run_length, starts)``: reading ``run_length`` elements at each start, in
    order, yields ``part`` in C order.
    """
    n = len(saved.shape)
    rel = [p - s for p, s in zip(part.offset, saved.offset)]
    if any(r < 0 or r + m > d for r, m, d in zip(rel, part.shape, saved.shape)):
        raise ValueError(f"{part} is not inside {saved}")
    strides = [volume(saved.shape[i + 1:]) for i in range(n)]
    k = n - 1  # the first axis from which the rest is contiguous
    while k > 0 and part.shape[k] == saved.shape[k]:
        k -= 1
    if n == 0:
        return 1, [0]
    run = part.shape[k] * strides[k]
    starts = []
    for index in itertools.product(*(range(rel[i], rel[i] + part.shape[i]) for i in range(k))):
        starts.append(sum(i * s for i, s in zip(index, strides)) + rel[k] * strides[k])
    return run, starts
