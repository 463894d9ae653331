"""Deterministic order: which shard comes when, and which sample comes when inside a shard.

Pure functions of ``(seed, epoch)`` and ``(seed, epoch, shard)``. They never depend on the
backend, the number of workers or the clock, so every backend and every restart sees the
same order. The permutation is a Fisher-Yates shuffle driven by ``random.Random(key).random()``,
whose output Python guarantees to be reproducible across versions for an integer seed;
keys come from BLAKE2b over the arguments, so neighbouring seeds give unrelated orders.

Trade-off: the shard order is materialised as a list (``O(num_shards)`` once per epoch,
cached); the sample order of one shard is materialised when the shard is consumed.
"""

from __future__ import annotations

import functools
import hashlib
import random
from typing import Sequence

__all__ = ["permutation", "sample_order", "shard_order"]


def _key(*parts: int) -> int:
    digest = hashlib.blake2b(
        b"sharding-order-v1:" + b":".join(str(p).encode() for p in parts), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


def permutation(n: int, key: int) -> list[int]:
    """Return a permutation of ``range(n)`` that depends only on ``(n, key)``."""
    if n < 0:
        raise ValueError(f"permutation size must be >= 0, got {n}")
    order = list(range(n))
    draw = random.Random(key).random
    for i in range(n - 1, 0, -1):
        j = int(draw() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return order


@functools.lru_cache(maxsize=8)
def _shuffled_shards(num_shards: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(permutation(num_shards, _key(seed, epoch)))


def shard_order(num_shards: int, *, seed: int, epoch: int, shuffle: bool) -> Sequence[int]:
    """Shard indices in the order epoch ``epoch`` hands them out (position -> shard index)."""
    if not shuffle:
        return range(num_shards)
    return _shuffled_shards(num_shards, seed, epoch)


def sample_order(
    start: int, end: int, *, seed: int, epoch: int, shard: int, shuffle: bool
) -> Sequence[int]:
    """Sample indices of the shard ``[start, end)`` in consumption order."""
    if not shuffle:
        return range(start, end)
    return [start + i for i in permutation(end - start, _key(seed, epoch, shard, 1))]
