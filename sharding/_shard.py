"""A leased shard: what a worker trains on, and the lease it holds it by."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ._order import sample_order

__all__ = ["Shard"]


@dataclass(frozen=True, slots=True)
class Shard:
    """One leased shard: samples ``[start, end)`` (of ``file`` for file-based data sets).

    ``consumed`` is where this lease resumes: samples of :meth:`indices` before it were
    already reported by an earlier holder.
    """

    dataset: str
    epoch: int
    index: int
    start: int
    end: int
    file: str | None
    consumed: int
    worker: str
    #: lease token; a later lease of the same shard gets a larger one
    lease: int
    slot: int = field(repr=False)
    seed: int = field(repr=False)
    shuffle: bool = field(repr=False)

    def __len__(self) -> int:
        return self.end - self.start

    def indices(self) -> Iterator[int]:
        """Sample indices (record offsets in ``file``) still to consume, in order."""
        order = sample_order(
            self.start, self.end, seed=self.seed, epoch=self.epoch, shard=self.index, shuffle=self.shuffle
        )
        return iter(order[self.consumed :])
