"""Committed steps over any :class:`~flashckpt.storage._protocol.Backend`, committed without rename.

Layout under the location::

    step-<N>/rank-<R>.<token>.safetensors  one shard per rank, the writing run's token in its name
    step-<N>/rank-<R>.<token>.done         its done marker (size, block crc32s, token), after the shard
    step-<N>/metadata.json                 world size, every shard's file, size, block crc32s, token,
                                           branch; written last: present = committed
    latest                                 a hint: the newest committed step

**Commit without rename.** A backend has no atomic rename of a prefix, but writing one
object is atomic: a reader sees the old object or the new one, never a part. So the
step's ``metadata.json`` is the commit. Whoever finds every rank's marker of its token
writes it (two savers finding them at once write the same record), then checks that
every shard it names is still there and retracts it otherwise (a concurrent cleanup of a
superseded upload). A crash at any moment leaves shards and markers without metadata,
which readers ignore (they read only steps with metadata and only the shards it names).
The next commit removes stale uploads: those of older lines (a dead or older run) and of
older steps of its own line, and half-written uploads the backend kept
(:meth:`~flashckpt.storage._protocol.Backend.sweep`). Re-saving a step (a rollback, a
newer line) overwrites its metadata in one write; the old line's shards are then stale
uploads. Retention deletes a step's metadata first, then its shards. Lines,
``keep_last`` and late commits follow :mod:`flashckpt.storage._policy`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ._checksum import block_crcs
from ._policy import Policy, commit_record, doomed, in_order, late_commit, superseded
from ._protocol import Backend, ObjectInfo
from ._step_meta import MAX_MARKER, ShardRecord, image_token, plain_name, validate_metadata

__all__ = ["BLOCK_BYTES", "CommittedStore", "block_bytes"]

log = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20
"""The checksum block of a shard in a backend (the disk's is 4 MiB): a ranged read
verifies every block it touches, so it fetches its range widened to whole blocks; over
the network a resharding load's small pieces (a third of a tensor's rows, a bias) would
otherwise fetch up to 8 MiB each that nothing needs. Grown for very large shards (see
:func:`block_bytes`), so a done marker stays far below its 1 MiB bound."""
_MAX_BLOCKS = 16_384
_STEP_KEY_RE = re.compile(r"^step-(\d+)/([^/]+)$")
_UPLOAD_RE = re.compile(r"^rank-(\d+)\.([A-Za-z0-9_+-]+)\.(safetensors|done)$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_+-]{1,64}$")


def _shard_object(rank: int, token: str) -> str:
    return f"rank-{rank}.{token}.safetensors"


def _marker_object(rank: int, token: str) -> str:
    return f"rank-{rank}.{token}.done"


def block_bytes(size: int) -> int:
    """The checksum block of a ``size``-byte shard: :data:`BLOCK_BYTES`, or a whole number
    of MiB keeping at most :data:`_MAX_BLOCKS` checksums (16 GiB shards and larger)."""
    per_block = -(-size // _MAX_BLOCKS)
    return max(BLOCK_BYTES, -(-per_block // (1 << 20)) << 20)


def _upload_token(name: str) -> str | None:
    """The run token in an upload's object name (``rank-R.<token>.safetensors|done``), else None."""
    m = _UPLOAD_RE.match(name)
    return m.group(2) if m else None


class CommittedStore(Policy):
    """Committed steps under one location of ``backend``. Construction does no I/O."""

    shared = True
    remote = True

    def shard_written(self, step: int, rank: int, token: str, image: memoryview) -> bool:
        """An object store cannot tell a durable shard of this save from another: False."""
        return False

    def hold_step(self, step: int) -> None:
        """An object store has no lock to hold a step with: None (retention is not held off)."""
        return None

    def apply_retention(self, keep_last: int, token: str) -> None:
        """Nothing is ever held here, so every commit's retention ran whole: nothing to do."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.root = backend.root

    # -- the backend, by name -------------------------------------------------------

    def _read_small(self, name: str, limit: int) -> bytes:
        return self.backend.read_small(name, limit)

    def _put_small(self, name: str, data: bytes) -> None:
        self.backend.write(name, memoryview(data))

    def _delete(self, names: list[str]) -> None:
        if names:
            self.backend.delete(names)

    def _tree(self, under: str = "") -> dict[int, dict[str, ObjectInfo]]:
        """The listing by step: step -> {object name -> info}."""
        steps: dict[int, dict[str, ObjectInfo]] = {}
        for name, info in self.backend.list(under).items():
            m = _STEP_KEY_RE.match(name)
            if m is not None:
                steps.setdefault(int(m.group(1)), {})[m.group(2)] = info
        return steps

    @staticmethod
    def _tree_idents(tree: dict[int, dict[str, ObjectInfo]]) -> dict[int, Any]:
        return {s: (info.size, info.ident) for s, names in tree.items() if (info := names.get("metadata.json"))}

    def _idents(self) -> dict[int, Any]:
        return self._tree_idents(self._tree())

    # -- one live run -------------------------------------------------------------

    def claim_run(self, token: str) -> None:
        """Hold the location's run lease for this run (see the backend's ``claim``). Called
        once per run, by rank 0; claiming again from the same process succeeds."""
        self.backend.claim(token)

    def release_run(self) -> None:
        """Give up this object's claim; the lease goes when the process's last claim goes."""
        self.backend.release()

    # -- writing ------------------------------------------------------------------

    def check_writable(self) -> None:
        """Prove an object can be written and deleted under the location: a missing bucket,
        denied credentials or an unreachable endpoint is a clear error here."""
        probe = f".probe-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            self._put_small(probe, b"ok")
            self._delete([probe])
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"checkpoint URL {self.root}: its bucket does not exist ({exc})") from exc
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint URL {self.root} is not writable: {exc}") from exc

    def write_shard(self, step: int, rank: int, token: str, image: memoryview) -> ShardRecord:
        """Write one rank's image as ``step-N/rank-R.<token>.safetensors``, its block
        checksums computed meanwhile, then its done marker. An image whose header names
        another run's token is refused. On failure a :class:`CheckpointError` is raised with
        the cause chained; what was uploaded stays for the next commit's sweep of stale
        uploads, as after a crash. A second writer of the same shard is no error (see
        :meth:`~flashckpt.storage._policy.Policy._write_once`)."""
        if not _TOKEN_RE.match(token):
            raise CheckpointError(f"run token {token[:80]!r} cannot name an object (letters, digits, _+- only)")
        theirs = image_token(image)
        if theirs is not None and theirs != token:
            raise CheckpointError(f"rank {rank} of step {step} was written by another run (token {theirs}); "
                                  f"this save's token is {token}: shards of two runs never commit together")
        return self._write_once(step, rank, token, image, lambda: self._upload_shard(step, rank, token, image))

    def _upload_shard(self, step: int, rank: int, token: str, image: memoryview) -> ShardRecord:
        name = f"step-{step}/{_shard_object(rank, token)}"
        try:
            block = block_bytes(len(image))
            with ThreadPoolExecutor(1, thread_name_prefix="flashckpt-crc32") as summer:
                sums = summer.submit(block_crcs, image, block)
                self.backend.write(name, image)
                record = ShardRecord(rank, len(image), sums.result(), block)
            self._put_small(f"step-{step}/{_marker_object(rank, token)}",
                            json.dumps({**record.to_json(), "token": token}).encode())
            return record
        except Exception as exc:
            # the object stays, as a crash would leave it (the next commit removes it if stale): a
            # second writer of this shard names the very object another writer's marker describes
            raise CheckpointError(f"writing rank {rank} of step {step} to {self.root} failed: {exc} "
                                  "(the previous committed step is intact)") from exc

    def try_commit(self, step: int, world_size: int, token: str, keep_last: int, *,
                   branch: int | None = None) -> bool:
        """Commit ``step`` if every rank's marker of run ``token`` is there: write its
        metadata (the commit), check that its shards are still there, apply the retention,
        remove stale uploads, move ``latest``. True if this call or an earlier one of the
        same run committed it; False if ranks are missing, or for a late commit of an older
        line whose step number a newer line already holds (its upload is removed).
        Safe to call from several savers at once (see the module docstring)."""
        names = self._tree(f"step-{step}").get(step, {})
        if any(_marker_object(r, token) not in names for r in range(world_size)):
            return "metadata.json" in names and self._committed_by(step, token)
        there = self._commit(step, self._tree_idents({step: names}).get(step))
        if late_commit(there, token):
            log.warning("discarding a late commit of step %d by an older run (token %s): %s holds that step "
                        "of a newer line", step, token, self.root)
            self._delete([f"step-{step}/{n}" for n in names if _upload_token(n) == token])
            return False
        if there is not None and there.token == token:
            return True
        meta = self._commit_record(step, world_size, token, branch, names)
        if meta is None:
            return False
        where = f"step-{step}/metadata.json"
        self._put_small(where, json.dumps(meta, indent=1).encode())
        present = self._tree(f"step-{step}").get(step, {})
        gone = [s["file"] for s in meta["shards"].values()
                if (info := present.get(s["file"])) is None or info.size != s["size"]]
        if gone:
            log.warning("retracting the commit of step %d in %s: %s vanished meanwhile (a newer commit removed "
                        "this superseded upload)", step, self.root, ", ".join(gone))
            if self._committed_by(step, token):
                self._delete([where])
            return False
        order = self._retain(keep_last, step, token)
        if order and self._read_latest() != order[-1]:
            self._put_small("latest", f"{order[-1]}\n".encode())
        log.info("committed step %d (%d shards, %.1f MiB) in %s", step, world_size,
                 sum(s["size"] for s in meta["shards"].values()) / 2**20, self.root)
        return True

    def _commit_record(self, step: int, world_size: int, token: str, branch: int | None,
                       names: dict[str, ObjectInfo]) -> dict | None:
        """The metadata committing ``step`` from the markers of run ``token`` (read at
        once), or None with an error logged when a marker or shard does not fit."""
        markers = [f"step-{step}/{_marker_object(r, token)}" for r in range(world_size)]
        oversize = [m for m in markers if names[m.split("/")[1]].size > MAX_MARKER]
        if oversize:
            log.error("not committing step %d: %s is larger than %d bytes", step, self._url(oversize[0]), MAX_MARKER)
            return None
        raw = self.backend.read_many(markers)
        shards = {}
        for rank, marker in enumerate(markers):
            body = raw.get(marker)
            try:
                if not isinstance(body, bytes):
                    raise ValueError(f"unreadable: {body}")
                rec = json.loads(body)
                if not isinstance(rec, dict) or rec.get("token") != token:
                    raise ValueError("it names another run")
                file = _shard_object(rank, token)
                if (info := names.get(file)) is None or info.size != rec.get("size"):
                    raise ValueError(f"{file} is missing or not {rec.get('size')!r} bytes")
            except ValueError as exc:
                log.error("not committing step %d: %s: %s", step, self._url(marker), exc)
                return None
            shards[str(rank)] = {"file": file, **{k: rec.get(k) for k in ("size", "block_size", "block_crc32")}}
        meta = commit_record(step, world_size, token, branch, shards)
        try:
            return validate_metadata(meta, step, self._url(f"step-{step}/metadata.json"))
        except CorruptCheckpointError as exc:
            log.error("not committing step %d: its markers do not make valid metadata: %s", step, exc)
            return None

    def _retain(self, keep_last: int, step: int, token: str) -> list[int]:
        """Delete abandoned steps of older lines and steps beyond ``keep_last`` in line
        order (never ``step``, nor a step whose metadata cannot be read): all their
        metadata first, then their shards and markers. Then remove stale uploads.
        Returns the committed steps left, in order."""
        tree = self._tree()
        commits = self._commits(self._tree_idents(tree))
        retired = {s: commits.pop(s).token for s in doomed(in_order(c.line for c in commits.values()), keep_last, step)}
        for s in retired:
            self._cache.pop(s, None)
        self._delete([f"step-{s}/metadata.json" for s in sorted(retired)])

        def stale(s: int, other: str) -> bool:
            if s in commits and (not commits[s].line.readable or commits[s].token == other):
                return False  # committed (or unreadable: which uploads it commits is unknown)
            return other == retired.get(s) or superseded(other, s, token, step)

        self._delete([f"step-{s}/{n}" for s, names in tree.items() for n in names
                      if (other := _upload_token(n)) is not None and stale(s, other)])

        def stale_name(name: str) -> bool:
            m = _STEP_KEY_RE.match(name)
            other = _upload_token(m.group(2)) if m else None
            return other is not None and stale(int(m.group(1)), other)

        self.backend.sweep(stale_name)
        return [ln.step for ln in in_order(c.line for c in commits.values())]

    # -- reading ------------------------------------------------------------------

    def _repair_latest(self, newest: int) -> None:
        try:
            self._put_small("latest", f"{newest}\n".encode())
        except CheckpointError as exc:  # a read-only bucket: the hint stays stale
            log.debug("cannot repair the latest hint in %s: %s", self.root, exc)

    def open_shard(self, step: int, rank: int) -> tuple[Any, dict]:
        """A committed shard opened for ranged reads (``.name`` is its URL) and its record
        (size, block checksums); the object must exist with the recorded size.

        The step's metadata is the one the process's last listing found (a load lists
        first, to pick its step), read again only when unknown: opening every rank's shard
        of a large world costs one metadata read, not one per shard. A step committed
        again since that listing is read as it was listed, or fails naming a shard the
        newer commit removed."""
        cached = self._cache.get(step)
        meta = cached[1].meta if cached is not None and cached[1].meta is not None else self.metadata(step)
        record = meta["shards"].get(str(rank))
        if record is None:
            raise CheckpointNotFoundError(
                f"step {step} in {self.root} has no shard for rank {rank} (world size {meta['world_size']})")
        name = f"step-{step}/{plain_name(record['file'], step, rank)}"
        try:
            size = self.backend.size(name)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"missing shard object {self._url(name)} of committed step {step}") from None
        if size != record["size"]:
            raise CorruptCheckpointError(f"{self._url(name)}: {size} bytes, the commit recorded {record['size']} "
                                         "(truncated or replaced?)")
        return self.backend.open_range(name, size), record
