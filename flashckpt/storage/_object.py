"""Committed checkpoints in an object store (S3 and any fsspec URL), committed without rename.

Layout under the URL ``<scheme>://<bucket>/<prefix>``::

    step-<N>/rank-<R>.<token>.safetensors  one shard per rank, the writing run's token in its name
    step-<N>/rank-<R>.<token>.done         its done marker (size, block crc32s, token), after the shard
    step-<N>/metadata.json                 world size, every shard's file, size, block crc32s, token,
                                           branch; written last: present = committed
    latest                                 a hint: the newest committed step
    .flashckpt-run.json                    the run lease (see :mod:`flashckpt.storage._object_lease`)

**Commit without rename.** Object stores have no atomic rename of a prefix, but one PUT
of one object is atomic: a reader sees the old object or the new one, never a part.
So the step's ``metadata.json`` is the commit. Whoever finds every rank's marker of its
token writes it (two savers finding them at once write the same record), then checks
that every shard it names is still there and retracts it otherwise (a concurrent cleanup
of a superseded upload). A crash at any moment leaves shards and markers without
metadata, which readers ignore (they read only steps with metadata and only the shards it
names). The next commit removes stale uploads: those of older lines (a dead or older
run) and of older steps of its own line, and an S3 multipart upload such a writer left
open. Re-saving a step (a rollback, a newer line) overwrites its metadata in one PUT;
the old line's shards are then stale uploads. Retention deletes a step's metadata
first, then its shards. Lines, ``keep_last`` and the rule that a late commit of an older
line never replaces a newer line's step are :mod:`flashckpt.storage._local`'s.

**Uploads.** A shard below two parts is one PUT; a larger one (S3) is a multipart upload
of :data:`PART_BYTES` parts (grown to stay within S3's 10,000 parts), :data:`CONCURRENCY`
parts in flight on a sliding window: enough parallel streams to fill a fast NIC (one S3
stream gives about 100 MB/s), and at most ``CONCURRENCY * PART_BYTES`` (256 MiB) of part
copies in memory (the HTTP client needs ``bytes``, not the shared-memory view). Uploads
run in the saver process, never on the training thread.

**Reads** are ranged GETs (:mod:`flashckpt.storage._object_shard`): one per reader chunk, the
first checksum block kept from the header's read, so a resharding load fetches only the
blocks it needs and a whole load fetches each byte once. Small objects (metadata,
markers, ``latest``, the lease) are read with a bounded range. Errors name the object's
URL; a missing bucket or object is a :class:`CheckpointNotFoundError`, denied access or
an unreachable endpoint a :class:`CheckpointError`, altered bytes a
:class:`CorruptCheckpointError`.

**Stores.** Everything above is plain fsspec (``pipe_file``, ``cat_file``, ``find``,
``rm``), so any fsspec URL works; S3 (s3fs) adds multipart uploads, the abort of stale
multipart uploads, and the run lease's conditional writes. Tested against an S3 server
(moto) and ``memory://``. GCS (``gs://``, gcsfs), Azure (``az://``, adlfs) and OSS
(``oss://``, ossfs) are untested here (no server of theirs installs in the test
environment): they take that generic path, a shard in one unchunked PUT, and an
advisory run lease.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

from . import _object_lease
from ._checksum import block_crcs
from ._object_shard import CONCURRENCY, ObjectShard, _call, _run_all, _translate
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ._step_meta import (MAX_LATEST, MAX_MARKER, MAX_METADATA, Line, ShardRecord, image_token, line_key, plain_name,
                         validate_metadata)
from ._local import LocalStorage
from ._url import OBJECT_SCHEMES, parse_location

__all__ = ["CONCURRENCY", "PART_BYTES", "ObjectShard", "ObjectStorage"]

log = logging.getLogger(__name__)

PART_BYTES = 16 << 20
"""Bytes per multipart part and per ranged GET of a large read (S3's minimum part is 5 MiB)."""
MAX_CONNECTIONS = 64
"""Connections of an S3 client (botocore keeps 10 unless configured): several shards'
parts at once; a ``max_pool_connections`` in fsspec's configuration wins."""
_MAX_PARTS = 10_000
BLOCK_BYTES = 1 << 20
"""The checksum block of a shard in an object store (the disk's is 4 MiB): a ranged read
verifies every block it touches, so it fetches its range widened to whole blocks; over
the network a resharding load's small pieces (a third of a tensor's rows, a bias) would
otherwise fetch up to 8 MiB each that nothing needs. Grown for very large shards (see
:func:`_block_bytes`), so a done marker stays far below its 1 MiB bound."""
_MAX_BLOCKS = 16_384
_STEP_KEY_RE = re.compile(r"^step-(\d+)/([^/]+)$")
_UPLOAD_RE = re.compile(r"^rank-(\d+)\.([A-Za-z0-9_+-]+)\.(safetensors|done)$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_+-]{1,64}$")


def _shard_object(rank: int, token: str) -> str:
    return f"rank-{rank}.{token}.safetensors"


def _marker_object(rank: int, token: str) -> str:
    return f"rank-{rank}.{token}.done"


def _block_bytes(size: int) -> int:
    """The checksum block of a ``size``-byte shard: :data:`BLOCK_BYTES`, or a whole number
    of MiB keeping at most :data:`_MAX_BLOCKS` checksums (16 GiB shards and larger)."""
    per_block = -(-size // _MAX_BLOCKS)
    return max(BLOCK_BYTES, -(-per_block // (1 << 20)) << 20)


class _Commit(NamedTuple):
    """A committed step's place in the order of steps, the run that committed it, and
    its metadata (None when unreadable)."""

    line: Line
    token: str | None
    meta: dict | None


_COMMITS: dict[str, dict[int, tuple[tuple, _Commit]]] = {}
"""Per URL: each committed step's (metadata object identity, line and token)."""


class ObjectStorage:
    """Committed steps under one object-store URL; the methods and semantics of
    :class:`~flashckpt.storage._local.LocalStorage`. Construction does no I/O."""

    def __init__(self, url: str, *, part_bytes: int = PART_BYTES, concurrency: int = CONCURRENCY,
                 lease_seconds: float = _object_lease.LEASE_SECONDS) -> None:
        location = parse_location(url)
        if location.url is None:
            raise CheckpointError(f"{url!r} is a local path, not an object-store URL; use LocalStorage")
        if part_bytes < 5 << 20 or concurrency < 1 or lease_seconds <= 0:
            raise ValueError("part_bytes must be at least 5 MiB, concurrency at least 1, lease_seconds positive")
        self.root = location.url
        self._part_bytes, self._concurrency, self._lease_seconds = part_bytes, concurrency, lease_seconds
        self._fs, self._base = _filesystem(location.url, location.scheme)
        self._commits = _COMMITS.setdefault(self.root, {})  # shared: the saver opens a storage per request

    # -- names --------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self._base}/{name}"

    def _url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _read_small(self, name: str, limit: int) -> bytes:
        """A small object's bytes, at most ``limit`` (one bounded ranged GET)."""
        data = _call(f"reading {self._url(name)}", self._fs.cat_file, self._key(name), start=0, end=limit + 1)
        if len(data) > limit:
            raise CorruptCheckpointError(f"{self._url(name)} is larger than {limit} bytes; refusing to read it")
        return data

    def _put_small(self, name: str, data: bytes) -> None:
        _call(f"writing {self._url(name)}", self._fs.pipe_file, self._key(name), data)

    def _list(self, under: str = "") -> dict[str, dict]:
        """Every object below the root (or below ``under/``) by name relative to the root, listed afresh."""
        top = self._key(under) if under else self._base
        self._fs.invalidate_cache(top)
        try:
            found = self._fs.find(top, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise _translate(exc, f"listing {self.root}") from exc
        cut = len(self._base) + 1
        return {key[cut:]: info for key, info in found.items()
                if key.startswith(f"{top}/") and info.get("type", "file") == "file"}

    def _tree(self, under: str = "") -> dict[int, dict[str, dict]]:
        """The listing by step: step -> {object name -> info}."""
        steps: dict[int, dict[str, dict]] = {}
        for name, info in self._list(under).items():
            m = _STEP_KEY_RE.match(name)
            if m is not None:
                steps.setdefault(int(m.group(1)), {})[m.group(2)] = info
        return steps

    def _delete(self, names: list[str]) -> None:
        if names:
            _call(f"deleting {len(names)} objects in {self.root}", self._fs.rm, [self._key(n) for n in names])

    # -- one live run -------------------------------------------------------------

    def claim_run(self, token: str) -> None:
        """Hold the run lease ``<url>/.flashckpt-run.json`` for this run (see
        :mod:`flashckpt.storage._object_lease`): a :class:`JobConflictError` naming the pid and host
        of another live run. Claiming again from the same process succeeds. Called once
        per run, by rank 0."""
        _object_lease.claim(self, token, self._lease_seconds)

    def release_run(self) -> None:
        """Give up this object's claim; the lease is deleted when the process's last claim goes."""
        _object_lease.release(self)

    # -- writing ------------------------------------------------------------------

    def check_writable(self) -> None:
        """Prove an object can be written and deleted under the URL: a missing bucket,
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
        """Upload one rank's image as ``step-N/rank-R.<token>.safetensors`` (multipart when
        large), its block checksums computed meanwhile, then its done marker. An image
        whose header names another run's token is refused. On failure the partial upload
        is removed and a :class:`CheckpointError` is raised with the cause chained."""
        if not _TOKEN_RE.match(token):
            raise CheckpointError(f"run token {token[:80]!r} cannot name an object (letters, digits, _+- only)")
        theirs = image_token(image)
        if theirs is not None and theirs != token:
            raise CheckpointError(f"rank {rank} of step {step} was written by another run (token {theirs}); "
                                  f"this save's token is {token}: shards of two runs never commit together")
        name = f"step-{step}/{_shard_object(rank, token)}"
        try:
            block = _block_bytes(len(image))
            with ThreadPoolExecutor(1, thread_name_prefix="flashckpt-crc32") as summer:
                sums = summer.submit(block_crcs, image, block)
                self._upload(name, image)
                record = ShardRecord(rank, len(image), sums.result(), block)
            self._put_small(f"step-{step}/{_marker_object(rank, token)}",
                            json.dumps({**record.to_json(), "token": token}).encode())
            return record
        except BaseException as exc:
            try:
                self._delete([name])
            except CheckpointError:
                pass
            if isinstance(exc, Exception):
                raise CheckpointError(f"writing rank {rank} of step {step} to {self.root} failed: {exc} "
                                      "(the previous committed step is intact)") from exc
            raise

    def _upload(self, name: str, image: memoryview) -> None:
        size = len(image)
        part = max(self._part_bytes, -(-size // _MAX_PARTS))
        if not hasattr(self._fs, "call_s3") or size < 2 * part:
            _call(f"uploading {self._url(name)}", self._fs.pipe_file, self._key(name), bytes(image))
            return
        bucket, key, _ = self._fs.split_path(self._key(name))
        what = f"uploading {self._url(name)}"
        upload = _call(what, self._fs.call_s3, "create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        count = -(-size // part)
        etags: list[str] = [""] * count

        def send(k: int) -> None:
            out = _call(f"{what} (part {k + 1} of {count})", self._fs.call_s3, "upload_part", Bucket=bucket, Key=key,
                        UploadId=upload, PartNumber=k + 1, Body=bytes(image[k * part:(k + 1) * part]))
            etags[k] = out["ETag"]

        try:
            _run_all(send, count, self._concurrency)
            _call(what, self._fs.call_s3, "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                  MultipartUpload={"Parts": [{"PartNumber": k + 1, "ETag": e} for k, e in enumerate(etags)]})
        except BaseException:
            try:
                self._fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            except Exception as exc:  # the next commit's cleanup aborts it
                log.warning("could not abort the multipart upload of %s: %s", self._url(name), exc)
            raise
        finally:
            self._fs.invalidate_cache(self._key(name))

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
        there = self._commit(step, names.get("metadata.json"))
        if there is not None and there.line.key > line_key(token):
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
        gone = [s["file"] for s in meta["shards"].values() if present.get(s["file"], {}).get("size") != s["size"]]
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
                       names: dict[str, dict]) -> dict | None:
        """The metadata committing ``step`` from the markers of run ``token`` (read at
        once), or None with an error logged when a marker or shard does not fit."""
        markers = [f"step-{step}/{_marker_object(r, token)}" for r in range(world_size)]
        oversize = [m for m in markers if names.get(m.split("/")[1], {}).get("size", 0) > MAX_MARKER]
        if oversize:
            log.error("not committing step %d: %s is larger than %d bytes", step, self._url(oversize[0]), MAX_MARKER)
            return None
        raw = _call(f"reading the done markers of step {step} in {self.root}", self._fs.cat,
                    [self._key(m) for m in markers], on_error="return")
        shards = {}
        for rank, marker in enumerate(markers):
            body = raw.get(self._key(marker))
            try:
                if not isinstance(body, bytes):
                    raise ValueError(f"unreadable: {body}")
                rec = json.loads(body)
                if not isinstance(rec, dict) or rec.get("token") != token:
                    raise ValueError("it names another run")
                file = _shard_object(rank, token)
                if names.get(file, {}).get("size") != rec.get("size"):
                    raise ValueError(f"{file} is missing or not {rec.get('size')!r} bytes")
            except ValueError as exc:
                log.error("not committing step %d: %s: %s", step, self._url(marker), exc)
                return None
            shards[str(rank)] = {"file": file, **{k: rec.get(k) for k in ("size", "block_size", "block_crc32")}}
        meta = {"format": "flashckpt/1", "step": step, "world_size": world_size, "token": token, "branch": branch,
                "committed_at": time.time(), "shards": shards}
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
        commits = self._commits_in(tree)
        retired = {s: commits.pop(s).token for s in _doomed(_in_order(commits.values()), keep_last, step)}
        for s in retired:
            self._commits.pop(s, None)
        self._delete([f"step-{s}/metadata.json" for s in sorted(retired)])
        mine = line_key(token)

        def stale(s: int, other: str) -> bool:
            if s in commits and (not commits[s].line.readable or commits[s].token == other):
                return False  # committed (or unreadable: which uploads it commits is unknown)
            return other == retired.get(s) or line_key(other) < mine or (line_key(other) == mine and s < step)

        self._delete([f"step-{s}/{n}" for s, names in tree.items() for n in names
                      if (other := _upload_token(n)) is not None and stale(s, other)])
        self._abort_stale_uploads(stale)
        return [ln.step for ln in _in_order(commits.values())]

    def _abort_stale_uploads(self, stale: Callable[[int, str], bool]) -> None:
        """Abort S3 multipart uploads of shards that a killed writer left open, where ``stale(step, token)``."""
        if not hasattr(self._fs, "list_multipart_uploads"):
            return
        bucket, prefix, _ = self._fs.split_path(self._base)
        try:
            uploads = self._fs.list_multipart_uploads(bucket)
        except Exception as exc:
            log.info("cannot list open multipart uploads in %s: %s", self.root, exc)
            return
        for upload in uploads:
            key = str(upload.get("Key", ""))
            m = _STEP_KEY_RE.match(key[len(prefix) + 1:] if prefix else key)
            other = _upload_token(m.group(2)) if m and (not prefix or key.startswith(f"{prefix}/")) else None
            if other is not None and stale(int(m.group(1)), other):
                try:
                    self._fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                     UploadId=upload["UploadId"])
                except Exception as exc:
                    log.info("cannot abort the stale multipart upload of %s: %s", upload["Key"], exc)

    # -- reading ------------------------------------------------------------------

    def _read_latest(self) -> int | None:
        try:
            return int(self._read_small("latest", MAX_LATEST).strip())
        except (CheckpointError, ValueError):
            return None

    def committed_steps(self) -> list[int]:
        """Committed step numbers (those with ``metadata.json``), ascending."""
        return sorted(s for s, names in self._tree().items() if "metadata.json" in names)

    def _commit(self, step: int, info: dict | None) -> _Commit | None:
        """The line and token of a committed step whose metadata object is ``info`` from a
        listing (cached by its size and ETag or time); None if not committed."""
        if info is None:
            return None
        ident = (info.get("size"), info.get("ETag") or info.get("LastModified") or info.get("created"))
        cached = self._commits.get(step)
        if cached is not None and cached[0] == ident:
            return cached[1]
        try:
            meta = self.metadata(step)
            there = _Commit(Line(line_key(meta.get("token")), step, meta.get("branch"), True), meta.get("token"),
                            meta)
        except CheckpointNotFoundError:
            return None
        except CheckpointError as exc:
            log.info("step %d is ordered as the oldest line: %s", step, exc)
            there = _Commit(Line("", step, None, False), None, None)
        self._commits[step] = (ident, there)
        return there

    def _commits_in(self, tree: dict[int, dict[str, dict]]) -> dict[int, _Commit]:
        """The commits of a full listing (the cache forgets steps that are gone)."""
        for gone in set(self._commits) - set(tree):
            self._commits.pop(gone, None)
        return {s: there for s, names in tree.items() if (there := self._commit(s, names.get("metadata.json")))}

    def _order(self) -> list[Line]:
        """Committed steps' lines by (line, step), what LocalStorage's ordering methods read."""
        return _in_order(self._commits_in(self._tree()).values())

    # LocalStorage's logic, written once: these read only ``self._order()``, ``self.metadata()``,
    # ``self.open_shard()`` and ``self.root``.
    _committed_by = LocalStorage._committed_by
    verify = LocalStorage.verify  # every shard through the one reader (ShardReader over an ObjectShard)
    steps_in_order = LocalStorage.steps_in_order
    newest_key = LocalStorage.newest_key
    newer_than_committed = LocalStorage.newer_than_committed

    def latest_step(self) -> int | None:
        """The newest committed step the store holds (``latest`` is only a hint, repaired
        best effort when it names another step)."""
        order = self.steps_in_order()
        newest = order[-1] if order else None
        if newest is not None and self._read_latest() != newest:
            try:
                self._put_small("latest", f"{newest}\n".encode())
            except CheckpointError as exc:  # a read-only bucket: the hint stays stale
                log.debug("cannot repair the latest hint in %s: %s", self.root, exc)
        return newest

    def metadata(self, step: int) -> dict:
        """The committed step's metadata, read bounded and checked for types."""
        where = f"step-{step}/metadata.json"
        try:
            raw = self._read_small(where, MAX_METADATA)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"step {step} is not committed in {self.root} (no {self._url(where)})"
                                          ) from None
        try:
            meta = json.loads(raw)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{self._url(where)}: unreadable metadata: {exc}") from exc
        return validate_metadata(meta, step, self._url(where))

    def open_shard(self, step: int, rank: int) -> tuple[ObjectShard, dict]:
        """A committed shard opened for ranged reads (``.name`` is its URL) and its record
        (size, block checksums); the object must exist with the recorded size.

        The step's metadata is the one the process's last listing found (a load lists
        first, to pick its step), read again only when unknown: opening every rank's shard
        of a large world costs one metadata GET, not one per shard. A step committed
        again since that listing is read as it was listed, or fails naming a shard the
        newer commit removed."""
        cached = self._commits.get(step)
        meta = cached[1].meta if cached is not None and cached[1].meta is not None else self.metadata(step)
        record = meta["shards"].get(str(rank))
        if record is None:
            raise CheckpointNotFoundError(
                f"step {step} in {self.root} has no shard for rank {rank} (world size {meta['world_size']})")
        name = f"step-{step}/{plain_name(record['file'], step, rank)}"
        self._fs.invalidate_cache(self._key(name))
        try:
            size = _call(f"reading {self._url(name)}", self._fs.size, self._key(name))
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"missing shard object {self._url(name)} of committed step {step}") from None
        if size != record["size"]:
            raise CorruptCheckpointError(f"{self._url(name)}: {size} bytes, the commit recorded {record['size']} "
                                         "(truncated or replaced?)")
        return ObjectShard(self._fs, self._key(name), self._url(name), size, concurrency=self._concurrency), record


def _upload_token(name: str) -> str | None:
    """The run token in an upload's object name (``rank-R.<token>.safetensors|done``), else None."""
    m = _UPLOAD_RE.match(name)
    return m.group(2) if m else None


def _in_order(commits: Any) -> list[Line]:
    """The lines of ``commits`` by (line, step): the last is the newest."""
    return sorted((c.line for c in commits), key=lambda ln: (ln.key, ln.step))


def _doomed(order: list[Line], keep_last: int, step: int) -> set[int]:
    """The steps retention deletes, given committed steps in (line, step) order: those of
    older lines past the newest line's branch, then all but the newest ``keep_last``;
    never ``step`` nor a step whose metadata is unreadable."""
    if not order:
        return set()
    newest = order[-1].key
    branch = next((ln.branch for ln in order if ln.key == newest and ln.branch is not None), None)
    abandoned = {ln.step for ln in order if branch is not None and ln.key < newest and ln.step > branch}
    survivors = [ln.step for ln in order if ln.step not in abandoned]
    beyond = set(survivors[:-keep_last]) if keep_last > 0 else set()
    return {ln.step for ln in order if ln.readable and ln.step != step} & (abandoned | beyond)


def _filesystem(url: str, scheme: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the root's path in it (imports fsspec and
    the scheme's backend only now)."""
    try:
        import fsspec.config
        from fsspec.core import url_to_fs

        options = {}
        if OBJECT_SCHEMES[scheme] == "s3fs":  # botocore's pool of 10 connections would cap the parts in flight
            config = dict(fsspec.config.conf.get("s3", {}).get("config_kwargs") or {})
            config.setdefault("max_pool_connections", MAX_CONNECTIONS)
            options["config_kwargs"] = config
        fs, path = url_to_fs(url, **options)
    except ImportError as exc:
        raise CheckpointError(f"{url}: {scheme}:// needs the {OBJECT_SCHEMES[scheme]} package "
                              f"(pip install 'flashckpt[s3]' for S3): {exc}") from exc
    except Exception as exc:
        raise _translate(exc, f"opening {url}") from exc
    return fs, path.rstrip("/")
