"""What a data set is: its samples, how they are cut into shards, and how many epochs.

A definition is validated once, stored as canonical JSON next to the lease state, and
compared on every reopen, so two processes can never work on different ideas of the
same data set.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ._errors import InvalidArgument
from ._order import shard_order

__all__ = ["Definition"]


def _whole(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(kw_only=True, frozen=True, slots=True)
class Definition:
    """A data set definition.

    Exactly one of ``size`` (samples ``0..size-1``) and ``files`` (``(path, num_records)``
    pairs, shards never cross a file) is given.
    """

    #: number of samples, for index-range data sets
    size: int | None = None
    #: ``(path, num_records)`` pairs, for file-based data sets
    files: tuple[tuple[str, int], ...] | None = None
    #: samples per shard (the last shard of a file or range may be shorter)
    shard_size: int
    #: epochs to hand out; ``None`` means endless
    num_epochs: int | None = 1
    #: permute shard order per (seed, epoch) and sample order per (seed, epoch, shard)
    shuffle: bool = False
    #: seed of the permutations
    seed: int = 0
    #: seconds a lease lives without a heartbeat or report
    lease_timeout: float = 60.0
    _first_shard: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _num_shards: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.size is None) == (self.files is None):
            raise InvalidArgument("give exactly one of size= and files=")
        _whole("shard_size", self.shard_size, minimum=1)
        if self.num_epochs is not None:
            _whole("num_epochs", self.num_epochs, minimum=1)
        _whole("seed", self.seed, minimum=0)
        if not isinstance(self.shuffle, bool):
            raise InvalidArgument(f"shuffle must be a bool, got {self.shuffle!r}")
        if (
            isinstance(self.lease_timeout, bool)
            or not isinstance(self.lease_timeout, (int, float))
            or not math.isfinite(self.lease_timeout)
            or self.lease_timeout <= 0
        ):
            raise InvalidArgument(f"lease_timeout must be a positive number of seconds, got {self.lease_timeout!r}")
        object.__setattr__(self, "lease_timeout", float(self.lease_timeout))
        if self.size is not None:
            _whole("size", self.size, minimum=1)
            object.__setattr__(self, "_num_shards", -(-self.size // self.shard_size))
            return
        files = tuple(self._checked_file(entry) for entry in self.files or ())
        if not files or sum(n for _, n in files) == 0:
            raise InvalidArgument("files= must name at least one record")
        object.__setattr__(self, "files", files)
        first, total = [], 0
        for _, records in files:
            first.append(total)
            total += -(-records // self.shard_size)
        object.__setattr__(self, "_first_shard", tuple(first))
        object.__setattr__(self, "_num_shards", total)

    @staticmethod
    def _checked_file(entry: Any) -> tuple[str, int]:
        try:
            path, records = entry
        except (TypeError, ValueError):
            raise InvalidArgument(f"files= entries must be (path, num_records), got {entry!r}") from None
        if not isinstance(path, str) or not path:
            raise InvalidArgument(f"file path must be a non-empty str, got {path!r}")
        return path, _whole(f"num_records of {path}", records, minimum=0)

    @property
    def num_shards(self) -> int:
        """Shards per epoch."""
        return self._num_shards

    def bounds(self, index: int) -> tuple[str | None, int, int]:
        """``(file, start, end)`` of shard ``index``; ``file`` is None for index ranges."""
        if not 0 <= index < self._num_shards:
            raise InvalidArgument(f"shard index {index} outside 0..{self.num_shards - 1}")
        if self.size is not None:
            start = index * self.shard_size
            return None, start, min(start + self.shard_size, self.size)
        assert self.files is not None
        f = bisect.bisect_right(self._first_shard, index) - 1
        path, records = self.files[f]
        start = (index - self._first_shard[f]) * self.shard_size
        return path, start, min(start + self.shard_size, records)

    def at_slot(self, epoch: int, slot: int) -> tuple[int, str | None, int, int]:
        """``(index, file, start, end)`` of the shard at ``slot`` of ``epoch``'s shard order."""
        index = shard_order(self._num_shards, seed=self.seed, epoch=epoch, shuffle=self.shuffle)[slot]
        return (index, *self.bounds(index))

    def to_json(self) -> dict[str, Any]:
        """The definition as a JSON-able dict (the stored and compared form)."""
        return {
            "size": self.size,
            "files": [list(f) for f in self.files] if self.files is not None else None,
            "shard_size": self.shard_size,
            "num_epochs": self.num_epochs,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "lease_timeout": self.lease_timeout,
        }

    def canonical(self) -> str:
        """Canonical JSON text; equal definitions give equal text."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Definition":
        """Inverse of :meth:`to_json`."""
        files: Iterable[Sequence[Any]] | None = data.get("files")
        return cls(
            size=data.get("size"),
            files=tuple((str(p), int(n)) for p, n in files) if files is not None else None,
            shard_size=data["shard_size"],
            num_epochs=data.get("num_epochs"),
            shuffle=data.get("shuffle", False),
            seed=data.get("seed", 0),
            lease_timeout=data.get("lease_timeout", 60.0),
        )
