"""One live run per object-store URL: a run lease instead of ``flock``.

Object stores have no locks that die with their holder. Rank 0 of a run writes
``<url>/.flashckpt-run.json`` (its token, host, pid, ``TORCHELASTIC_RUN_ID``, and a
heartbeat time) and a daemon thread rewrites it every quarter of ``lease_seconds``. A
lease of another run counts as live while its heartbeat is younger than
``lease_seconds`` (clocks assumed within a few seconds of each other), unless its pid is
dead on this host or it carries this job's ``TORCHELASTIC_RUN_ID`` (a restart of the
same job); a live lease is a :class:`JobConflictError` naming its pid and host.
torchrun's default run id, "none", names no job: a job launched without ``--rdzv-id``
whose rank 0 comes back on another host is refused until the old lease expires.

**Exclusive on S3.** Every write of the lease is a conditional PUT: ``If-None-Match: *``
creates it, ``If-Match: <ETag read>`` takes over a dead run's lease and renews one's
own. Of runs claiming at the same instant the store lets exactly one write succeed; the
others read the winner's lease and raise :class:`JobConflictError`. A renewal refused
because another run took the lease over (this run stalled past ``lease_seconds``) stops
renewing, with an error logged; release deletes the lease only while it is still this
run's (``If-Match``). AWS S3, MinIO and moto honour these headers.

**Advisory elsewhere.** A store without conditional writes (a non-S3 fsspec backend such
as ``memory://`` or ``gs://``, or an S3-compatible server answering ``NotImplemented``)
keeps a best-effort lease, logged once per URL: read, then write, so two runs claiming
in the same instant may both succeed; each heartbeat then notices the other's token and
the run that lost stops renewing with an error logged. An S3-compatible server that
silently ignores the headers cannot be told apart and is advisory too.

Trade-off: a run that died on another host blocks the URL for up to ``lease_seconds``
(60 s).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, JobConflictError
from ._object_shard import _call, _translate
from ..memory._slot import pid_alive
from ._step_meta import MAX_MARKER

if TYPE_CHECKING:
    from ._fsspec import FsspecBackend

__all__ = ["LEASE", "LEASE_SECONDS", "claim", "release"]

log = logging.getLogger(__name__)

LEASE = ".flashckpt-run.json"
LEASE_SECONDS = 60.0
"""A run lease not renewed for this long belongs to a dead run."""
_NO_RUN_ID = ("", "none")
"""Run ids that name no job: torchrun's default ``--rdzv-id`` is "none" for every job."""
_ATTEMPTS = 4
"""Claims retried when the lease changed between its read and the conditional write."""


class _Lost(Exception):
    """A conditional write or delete refused: the lease is not the one read."""


class _Found(NamedTuple):
    """The lease object as read: its record (None if absent or unreadable), whether it
    exists, and its ETag (None without conditional writes)."""

    record: dict | None
    exists: bool
    etag: str | None


class _Lease:
    """This process's hold of one URL's run lease, renewed by a daemon thread."""

    def __init__(self, storage: FsspecBackend, record: dict, seconds: float, etag: str | None) -> None:
        self.pid, self.record, self.seconds, self.etag = os.getpid(), record, seconds, etag
        self.holders: weakref.WeakSet[FsspecBackend] = weakref.WeakSet([storage])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_renew, args=(storage, self), name="flashckpt-lease", daemon=True)
        self.thread.start()


_LEASES: dict[str, _Lease] = {}
_GUARD = threading.Lock()
_ADVISORY: set[str] = set()
"""URLs whose lease is advisory (already logged)."""


def claim(storage: FsspecBackend, token: str, seconds: float) -> None:
    """Hold ``storage``'s run lease for run ``token`` (see the module docstring)."""
    with _GUARD:
        held = _LEASES.get(storage.root)
        if held is not None and held.pid == os.getpid():
            held.holders.add(storage)
            return
        record = {"token": token, "host": socket.gethostname(), "pid": os.getpid(),
                  "run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""), "started_at": time.time()}
        for _ in range(_ATTEMPTS):
            found = _read(storage)
            other = found.record
            if other is not None and other.get("token") != token and _live(other, seconds):
                raise JobConflictError(_conflict(storage, other, seconds))
            try:
                etag = _write(storage, record, None if found.exists else "*", found.etag)
                break
            except _Lost:  # written by another claimant since the read: read the winner's lease
                continue
        else:
            raise JobConflictError(f"the run lease {storage.root}/{LEASE} changed under each of {_ATTEMPTS} claims "
                                   "(other runs are claiming this URL); give this run another checkpoint URL")
        _LEASES[storage.root] = _Lease(storage, record, seconds, etag)


def release(storage: FsspecBackend) -> None:
    """Give up ``storage``'s claim; the lease is deleted when the process's last claim goes."""
    with _GUARD:
        held = _LEASES.get(storage.root)
        if held is None or held.pid != os.getpid() or storage not in held.holders:
            return
        held.holders.discard(storage)
        if held.holders:
            return
        del _LEASES[storage.root]
    held.stop.set()
    held.thread.join()
    try:
        found = _read(storage)
        if found.record is not None and found.record.get("token") == held.record["token"]:
            _delete(storage, found.etag)
    except _Lost:
        pass  # taken over since the read: not this run's to delete
    except CheckpointError as exc:
        log.warning("could not remove the run lease (it expires by itself): %s", exc)


def _conditional(storage: FsspecBackend) -> bool:
    """Whether the lease of ``storage`` is written conditionally (an S3 store that has
    not refused conditional writes); logs once per URL when it is advisory."""
    if hasattr(storage.fs, "call_s3") and storage.root not in _ADVISORY:
        return True
    _advisory(storage, "the store has no conditional writes")
    return False


def _advisory(storage: FsspecBackend, why: str) -> None:
    if storage.root not in _ADVISORY:
        _ADVISORY.add(storage.root)
        log.warning("the run lease %s/%s is advisory (%s): two runs started at the same instant may both claim "
                    "it; give each run its own checkpoint URL", storage.root, LEASE, why)


def _refused(exc: BaseException, *codes: str) -> bool:
    """Whether an S3 client error (or one it caused) carries one of the error ``codes`` or HTTP statuses."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = str((response.get("ResponseMetadata") or {}).get("HTTPStatusCode", ""))
            if error.get("Code") in codes or status in codes:
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def _s3_call(storage: FsspecBackend, what: str, method: str, **kwargs: Any) -> Any:
    """One S3 API call on the lease object, a precondition refusal as :class:`_Lost`."""
    bucket, key, _ = storage.fs.split_path(storage.key(LEASE))
    try:
        return storage.fs.call_s3(method, Bucket=bucket, Key=key, **kwargs)
    except FileExistsError as exc:  # s3fs's translation of a refused If-None-Match
        raise _Lost() from exc
    except Exception as exc:
        if _refused(exc, "PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
            raise _Lost() from exc
        if (isinstance(exc, OSError) and exc.errno == errno.ENOSYS) or _refused(exc, "NotImplemented", "501"):
            raise NotImplementedError(str(exc)) from exc
        raise _translate(exc, f"{what} {storage.root}/{LEASE}") from exc


def _write(storage: FsspecBackend, record: dict, if_none_match: str | None, if_match: str | None) -> str | None:
    """Write ``record`` with a fresh heartbeat: conditionally on S3 (``If-None-Match`` when
    given, else ``If-Match``); its new ETag, or None when written unconditionally."""
    body = json.dumps({**record, "heartbeat_at": time.time()}).encode()
    if _conditional(storage):
        condition = {"IfNoneMatch": if_none_match} if if_none_match else {"IfMatch": if_match} if if_match else {}
        try:
            return _s3_call(storage, "writing", "put_object", Body=body, **condition).get("ETag")
        except NotImplementedError as exc:
            _advisory(storage, f"the server refused a conditional write: {exc}")
    storage.write(LEASE, memoryview(body))
    return None


def _delete(storage: FsspecBackend, etag: str | None) -> None:
    if etag is not None and _conditional(storage):
        try:
            _s3_call(storage, "deleting", "delete_object", IfMatch=etag)
            return
        except NotImplementedError:
            pass  # a conditional delete is newer than conditional writes: delete as read
    storage.delete([LEASE])


def _read(storage: FsspecBackend) -> _Found:
    """The lease as it is now; on S3 with the ETag of the very bytes read (one GET)."""
    try:
        if _conditional(storage):
            raw, etag = _get_with_etag(storage)
        else:
            raw, etag = storage.read_small(LEASE, MAX_MARKER), None
    except CheckpointNotFoundError:
        return _Found(None, False, None)
    try:
        if len(raw) > MAX_MARKER:
            raise CorruptCheckpointError(f"larger than {MAX_MARKER} bytes")
        lease = json.loads(raw)
    except (ValueError, CorruptCheckpointError) as exc:
        log.warning("ignoring the unreadable run lease %s/%s: %s", storage.root, LEASE, exc)
        return _Found(None, True, etag)
    return _Found(lease if isinstance(lease, dict) else None, True, etag)


def _get_with_etag(storage: FsspecBackend) -> tuple[bytes, str | None]:
    from fsspec.asyn import sync

    async def get() -> tuple[bytes, str | None]:
        bucket, key, _ = storage.fs.split_path(storage.key(LEASE))
        resp = await storage.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{MAX_MARKER}")
        try:
            return await resp["Body"].read(), resp.get("ETag")
        finally:
            resp["Body"].close()

    return _call(f"reading {storage.root}/{LEASE}", sync, storage.fs.loop, get)


def _live(lease: dict, seconds: float) -> bool:
    try:
        age = time.time() - float(lease["heartbeat_at"])
        pid, host, run_id = int(lease["pid"]), str(lease["host"]), str(lease.get("run_id", ""))
    except (KeyError, TypeError, ValueError):
        return False
    if age > seconds or (run_id not in _NO_RUN_ID and run_id == os.environ.get("TORCHELASTIC_RUN_ID")):
        return False
    return not (host == socket.gethostname() and not pid_alive(pid))


def _conflict(storage: FsspecBackend, lease: dict, seconds: float) -> str:
    return (f"another run is live in {storage.root}: pid {str(lease.get('pid'))[:20]} on host "
            f"{str(lease.get('host'))[:255]} renewed {LEASE} within the last {seconds:.0f}s; stop it, or give "
            "this run another checkpoint URL")


def _renew(storage: FsspecBackend, lease: _Lease) -> None:
    """Renew ``lease`` until stopped, or until another run took the lease over."""
    while not lease.stop.wait(lease.seconds / 4):
        try:
            if not _renew_once(storage, lease):
                return
        except CheckpointError as exc:
            log.warning("renewing the run lease failed (retrying): %s", exc)


def _renew_once(storage: FsspecBackend, lease: _Lease) -> bool:
    """Write a new heartbeat; False (an error logged) if another run holds the lease now."""
    if lease.etag is None:  # advisory: look before writing
        there = _read(storage).record
        if there is not None and there.get("token") != lease.record["token"]:
            return _taken_over(storage, lease, there)
    try:
        lease.etag = _write(storage, lease.record, None, lease.etag)
        return True
    except _Lost:
        found = _read(storage)
        if found.record is not None and (found.record.get("token"), found.record.get("pid")) == (
                lease.record["token"], lease.pid):
            lease.etag = found.etag  # our own write, answered late (a client retry): still ours
            return True
        return _taken_over(storage, lease, found.record or {})


def _taken_over(storage: FsspecBackend, lease: _Lease, there: dict) -> bool:
    log.error("the run lease %s/%s was taken over: %s; no longer renewing it", storage.root, LEASE,
              _conflict(storage, there, lease.seconds))
    return False
