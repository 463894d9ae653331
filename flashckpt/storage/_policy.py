"""The policy over committed steps, written once for every storage.

**Lines.** Every run has a token; new tokens are time ordered, older or foreign tokens
sort first (:func:`~flashckpt.storage._step_meta.line_key`). The steps committed with one
token are a *line*; its ``branch`` is the step the run started from (-1: from nothing).
Committed steps are ordered by (line, step): the newest line wins even with smaller step
numbers (a rollback, a rerun into a used location). When the newest line has committed,
steps of older lines past its branch are abandoned (:func:`doomed`); ``keep_last`` then
keeps the newest steps in that order. A late commit of an older line never becomes the
newest and never replaces a newer line's step (:func:`late_commit`).

**The location is the truth.** ``latest`` is a hint, repaired when it names another
step. A step's line is read from its metadata once per metadata identity
(:class:`Policy` caches it per location).

:class:`Policy` is the part both storages share, over their
:class:`~flashckpt.storage._protocol.Backend` (``backend``: metadata and the ``latest``
hint are read through its primitives); each storage supplies three hooks: the committed
steps' metadata identities, ``open_shard`` and the ``latest`` hint's repair.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Iterable, NamedTuple

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..restore._shard_read import ShardReader
from ._protocol import Backend
from ._checksum import block_crcs
from ._step_meta import MAX_LATEST, MAX_METADATA, Line, ShardRecord, line_key, validate_metadata

__all__ = ["Commit", "Policy", "commit_record", "doomed", "in_order", "late_commit", "superseded"]

log = logging.getLogger(__name__)


class Commit(NamedTuple):
    """A committed step's place in the order, the run that committed it, and its metadata
    (None when unreadable)."""

    line: Line
    token: str | None
    meta: dict | None


_CACHES: dict[str, dict[int, tuple[Any, Commit]]] = {}
"""Per location: each committed step's (metadata identity, commit)."""


def in_order(lines: Iterable[Line]) -> list[Line]:
    """``lines`` by (line, step): the last is the newest."""
    return sorted(lines, key=lambda ln: (ln.key, ln.step))


def doomed(order: list[Line], keep_last: int, step: int) -> set[int]:
    """The steps retention removes, given committed steps in (line, step) order: those of
    older lines past the newest line's branch, then all but the newest ``keep_last``;
    never ``step`` (just committed) nor a step whose metadata is unreadable."""
    if not order:
        return set()
    newest = order[-1].key
    branch = next((ln.branch for ln in order if ln.key == newest and ln.branch is not None), None)
    abandoned = {ln.step for ln in order if branch is not None and ln.key < newest and ln.step > branch}
    survivors = [ln.step for ln in order if ln.step not in abandoned]
    beyond = set(survivors[:-keep_last]) if keep_last > 0 else set()
    return {ln.step for ln in order if ln.readable and ln.step != step} & (abandoned | beyond)


def late_commit(there: Commit | None, token: str) -> bool:
    """Whether committing a step that ``there`` holds, for run ``token``, is a late commit
    of an older line (discarded)."""
    return there is not None and there.line.key > line_key(token)


def superseded(token: str, step: int, mine: str, committed: int) -> bool:
    """Whether a pending save of ``step`` by run ``token`` can no longer become the newest
    once step ``committed`` of run ``mine`` is: it is of an older line, or an older step of
    that line. Its uploads (or directory) are then removed, unless a writer is live."""
    return line_key(token) < line_key(mine) or (line_key(token) == line_key(mine) and step < committed)


def commit_record(step: int, world_size: int, token: str, branch: int | None, shards: dict[str, dict],
                  ranks: list[int] | None = None) -> dict:
    """The metadata that commits ``step``: ``shards`` maps each rank to its file, size and
    block checksums; ``ranks`` is a node-local directory's scope."""
    meta = {"format": "flashckpt/1", "step": step, "world_size": world_size, "token": token, "branch": branch,
            "committed_at": time.time(),
            "shards": {r: {k: s[k] for k in ("file", "size", "block_size", "block_crc32")} for r, s in shards.items()}}
    if ranks is not None:
        meta["ranks"] = ranks
    return meta


class Policy:
    """Order, ``latest``, verify and the line cache over a storage's hooks."""

    root: str
    backend: Backend

    # -- hooks ----------------------------------------------------------------------

    def _idents(self) -> dict[int, Any]:
        """Each committed step's metadata identity, listed afresh."""
        raise NotImplementedError

    def open_shard(self, step: int, rank: int) -> tuple[Any, dict]:
        raise NotImplementedError

    def _repair_latest(self, newest: int) -> None:
        """Point the ``latest`` hint at ``newest``, best effort."""
        raise NotImplementedError

    # -- the policy -----------------------------------------------------------------

    def _url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _read_latest(self) -> int | None:
        """The step the ``latest`` hint names; None when it is missing or unreadable."""
        try:
            return int(self.backend.read_small("latest", MAX_LATEST).strip())
        except (CheckpointError, ValueError):
            return None

    def metadata(self, step: int) -> dict:
        """The committed step's metadata, read bounded and checked for types."""
        where = f"step-{step}/metadata.json"
        try:
            raw = self.backend.read_small(where, MAX_METADATA)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"step {step} is not committed in {self.root} (no {self._url(where)})"
                                          ) from None
        try:
            meta = json.loads(raw)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{self._url(where)}: unreadable metadata: {exc}") from exc
        return validate_metadata(meta, step, self._url(where))

    @property
    def _cache(self) -> dict[int, tuple[Any, Commit]]:
        return _CACHES.setdefault(self.root, {})

    def _commit(self, step: int, ident: Any) -> Commit | None:
        """The commit of ``step`` whose metadata has identity ``ident`` (cached); None if
        it is not committed."""
        if ident is None:
            return None
        cached = self._cache.get(step)
        if cached is not None and cached[0] == ident:
            return cached[1]
        try:
            meta = self.metadata(step)
            there = Commit(Line(line_key(meta.get("token")), step, meta.get("branch"), True), meta.get("token"), meta)
        except CheckpointNotFoundError:
            return None
        except CheckpointError as exc:
            log.info("step %d is ordered as the oldest line: %s", step, exc)
            there = Commit(Line("", step, None, False), None, None)
        self._cache[step] = (ident, there)
        return there

    def _commits(self, idents: dict[int, Any] | None = None) -> dict[int, Commit]:
        """The commits of a full listing (the cache forgets steps that are gone)."""
        idents = self._idents() if idents is None else idents
        for gone in set(self._cache) - set(idents):
            self._cache.pop(gone, None)
        return {s: there for s, ident in idents.items() if (there := self._commit(s, ident)) is not None}

    def _order(self) -> list[Line]:
        return in_order(c.line for c in self._commits().values())

    def committed_steps(self) -> list[int]:
        """Committed step numbers, ascending."""
        return sorted(self._idents())

    def steps_in_order(self) -> list[int]:
        """Committed steps from oldest to newest by (line, step): the last is the newest."""
        return [ln.step for ln in self._order()]

    def newest_key(self) -> tuple[str, int] | None:
        """(line, step) of the newest committed step, the order :meth:`steps_in_order` uses."""
        order = self._order()
        return (order[-1].key, order[-1].step) if order else None

    def newer_than_committed(self, token: str, step: int) -> bool:
        """Whether ``step`` saved by run ``token`` would be newer than every committed step
        (by line, then step): a copy in memory that storage does not supersede."""
        newest = self.newest_key()
        return newest is None or (line_key(token), step) > newest

    def latest_step(self) -> int | None:
        """The newest committed step the location holds (``latest`` is only a hint; it is
        repaired, best effort, when it names another step)."""
        order = self.steps_in_order()
        newest = order[-1] if order else None
        if newest is not None and self._read_latest() != newest:
            self._repair_latest(newest)
        return newest

    def _committed_by(self, step: int, token: str) -> bool:
        try:
            return self.metadata(step).get("token") == token
        except CheckpointError:
            return False

    def _write_once(self, step: int, rank: int, token: str, image: memoryview,
                    write: Callable[[], ShardRecord]) -> ShardRecord:
        """``write()`` rank ``rank``'s shard of ``step`` unless it is committed already with
        exactly ``image``; a write that fails (:class:`CheckpointError`) once the step committed
        with exactly these bytes (another writer of the same save completed it meanwhile)
        returns the committed record. A second writer of a shard (a rank's slot and a replica
        of it, a repeated persist) is so no error, and never writes a committed shard again."""
        if (committed := self._committed_shard(step, rank, token, image)) is not None:
            log.info("rank %d of step %d is committed in %s already; not writing it again", rank, step, self.root)
            return committed
        try:
            return write()
        except CheckpointError:
            if (committed := self._committed_shard(step, rank, token, image)) is None:
                raise
            log.info("rank %d of step %d was committed in %s by another writer of this save while this one wrote it",
                     rank, step, self.root)
            return committed

    def _committed_shard(self, step: int, rank: int, token: str, image: memoryview) -> ShardRecord | None:
        """The record of rank ``rank``'s shard of ``step`` when run ``token`` committed that step
        and the shard holds exactly ``image`` (its size and block checksums); else None."""
        try:
            meta = self.metadata(step)
        except CheckpointError:
            return None
        shard = meta.get("shards", {}).get(str(rank)) if meta.get("token") == token else None
        if (not isinstance(shard, dict) or shard.get("size") != len(image)
                or not isinstance(shard.get("block_size"), int) or shard["block_size"] <= 0):
            return None
        if shard.get("block_crc32") != block_crcs(image, shard["block_size"]):
            return None
        return ShardRecord(rank, len(image), shard["block_crc32"], shard["block_size"])

    def verify(self, step: int) -> list[str]:
        """Re-read every shard of ``step``; the problems found (empty when intact).

        Bounded by the shards the metadata lists: a huge ``world_size`` is one problem,
        not a loop. A shard whose header names another run's token is a problem."""
        meta = self.metadata(step)
        problems = _missing_ranks(meta, step, self.root)
        token = meta.get("token")
        for rank in sorted(meta["shards"], key=int):
            try:
                reader = ShardReader(*self.open_shard(step, int(rank)))
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            with reader:
                theirs = reader.image.meta.get("token")
                if token and isinstance(theirs, str) and theirs != token:
                    problems.append(f"{reader.path} was written by another run (token {theirs}); step {step} was "
                                    f"committed by run {token}")
                    continue
                try:
                    reader.verify()
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
        return problems


def _missing_ranks(meta: dict, step: int, root: str) -> list[str]:
    """The problem of ranks without a shard in ``meta`` (at most one, naming a few ranks)."""
    world, shards = meta["world_size"], meta["shards"]
    if isinstance(meta.get("ranks"), list):  # a node-local directory's step: the ranks of its scope
        missing = [r for r in meta["ranks"] if str(r) not in shards]
        return [f"step {step} in {root}: ranks {missing[:5]} of its node's scope have no shard"] if missing else []
    if len(shards) >= world:
        return []
    missing = []
    rank = 0
    while len(missing) < 5 and rank < world:
        if str(rank) not in shards:
            missing.append(rank)
        rank += 1
    last = [] if str(world - 1) in shards or world - 1 in missing else ["...", world - 1]
    return [f"step {step} in {root}: {world - len(shards)} of {world} ranks have no shard "
            f"(missing ranks {', '.join(map(str, missing + last))})"]
