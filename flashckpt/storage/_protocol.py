"""The two protocols of the storage layer.

:class:`Backend` is the byte store under a checkpoint location: a few primitives on
named objects (``step-3/metadata.json``), modelled on DCP's ``FileSystemBase``. Writing
an object is atomic (a reader sees all of it or none), so the committed-step policy of
:mod:`flashckpt.storage._committed` (commit record last, lines, retention, ``latest``,
verify) runs on any backend unchanged. A new backend is one module of these primitives
and one :func:`flashckpt.storage.register`.

:class:`Storage` is what the rest of flashckpt calls: committed steps of one location,
whatever holds them (:class:`~flashckpt.storage._local.LocalStorage` for a directory,
which commits by rename, or a :class:`~flashckpt.storage._committed.CommittedStore`
over a backend).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

from ._step_meta import ShardRecord

__all__ = ["Backend", "ObjectInfo", "RangeFile", "Storage"]


class ObjectInfo(NamedTuple):
    """A listed object: its size and an identity that changes when it is rewritten
    (an ETag, a modification time, an inode)."""

    size: int
    ident: Any


class RangeFile(Protocol):
    """An object opened for ranged reads (what ``ShardReader`` reads): ``name`` (where, for
    messages), ``size``, and exact positional reads into caller buffers. An ``io.FileIO``
    with ``name`` set qualifies."""

    name: Any

    def readinto(self, view: Any) -> int | None: ...

    def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """Byte primitives on the objects under one location. Names are relative ``/``-joined
    plain names; errors are :class:`~flashckpt.CheckpointError` subclasses
    (:class:`~flashckpt.CheckpointNotFoundError` for a missing object) naming the object."""

    root: str
    """The location, as messages show it (a URL)."""

    def write(self, name: str, data: memoryview) -> None:
        """Store ``data`` as object ``name`` durably and atomically (replacing one there)."""

    def read_small(self, name: str, limit: int) -> bytes:
        """The object's bytes, at most ``limit`` (a larger object is a ``CorruptCheckpointError``)."""

    def read_many(self, names: list[str]) -> dict[str, bytes | Exception]:
        """Several small objects at once: each name's bytes, or the error reading it."""

    def open_range(self, name: str, size: int) -> RangeFile:
        """The object (``size`` bytes, as listed) opened for ranged reads into buffers."""

    def size(self, name: str) -> int:
        """The object's size now (not cached)."""

    def list(self, under: str = "") -> dict[str, ObjectInfo]:
        """Every object below the root (or below ``under/``), listed afresh, by name."""

    def delete(self, names: list[str]) -> None:
        """Remove objects; a missing one is not an error."""

    def claim(self, token: str) -> None:
        """Take the location's run lease for run ``token`` (one live run per location):
        :class:`~flashckpt.JobConflictError` naming the other live run."""

    def release(self) -> None:
        """Give up this object's claim of the run lease."""

    def sweep(self, stale: Callable[[str], bool]) -> None:
        """Drop half-written uploads whose object ``name`` is ``stale(name)`` (a store's
        open multipart uploads); nothing where writes leave no such trace."""


@runtime_checkable
class Storage(Protocol):
    """Committed steps of one checkpoint location (see :mod:`flashckpt.storage._policy`)."""

    root: str
    shared: bool
    """Every node sees the same steps (an object store). False: a path each node may
    resolve to a disk of its own, which the engine checks at construction."""
    remote: bool
    """Opening an object costs a network round trip, so readers open many at once."""

    def claim_run(self, token: str) -> None: ...

    def release_run(self) -> None: ...

    def check_writable(self) -> None: ...

    def write_shard(self, step: int, rank: int, token: str, image: memoryview) -> ShardRecord: ...

    def try_commit(self, step: int, world_size: int, token: str, keep_last: int, *,
                   branch: int | None = None) -> bool: ...

    def committed_steps(self) -> list[int]: ...

    def steps_in_order(self) -> list[int]: ...

    def newest_key(self) -> tuple[str, int] | None: ...

    def newer_than_committed(self, token: str, step: int) -> bool: ...

    def latest_step(self) -> int | None: ...

    def metadata(self, step: int) -> dict: ...

    def open_shard(self, step: int, rank: int) -> tuple[Any, dict]: ...

    def verify(self, step: int) -> list[str]: ...

    def shard_written(self, step: int, rank: int, token: str, image: memoryview) -> bool:
        """Whether this save's shard of ``step`` is durable already (an earlier persist of it
        ended before the commit); False where the storage cannot tell, and it is written again."""
        ...

    def hold_step(self, step: int) -> Any:
        """Keep committed ``step`` from retention until the returned hold is closed; None
        where the storage cannot hold a step (a commit may then retire it while it is read)."""
        ...

    def apply_retention(self, keep_last: int, token: str) -> None:
        """Retire what a commit's retention had to leave because a step was held."""
        ...
