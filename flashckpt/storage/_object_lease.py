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

**Exclusive on S3 and Azure Blob.** Every write of the lease is conditional
(:mod:`flashckpt.storage._conditional`): created only if absent (``If-None-Match: *``);
a dead run's lease taken over, and one's own renewed, only while it is the version read
(``If-Match: <ETag>``). Of runs claiming at the same instant the store lets exactly one
write succeed; the others read the winner's lease and raise :class:`JobConflictError`. A
renewal refused because another run took the lease over (this run stalled past
``lease_seconds``) stops renewing, with an error logged; release deletes the lease only
while it is still this run's version. AWS S3, MinIO, moto and Azurite honour these headers.

**Advisory elsewhere.** A store without conditional writes here (``gs://``, whose test
server ignores GCS's preconditions; ``memory://``; an S3-compatible server answering
``NotImplemented``) keeps a best-effort lease, logged once per URL: read, then write, so
two runs claiming in the same instant may both succeed; each heartbeat then notices the
other's token and the run that lost stops renewing with an error logged. A server that
silently ignores the headers cannot be told apart and is advisory too.

Trade-off: a run that died on another host blocks the URL for up to ``lease_seconds``
(60 s).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, NamedTuple

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, JobConflictError
from ._conditional import ConditionalObject, PreconditionFailed, conditional_object
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


class _Found(NamedTuple):
    """The lease object as read: its record (None if absent or unreadable), whether it
    exists, and its version (None without conditional writes)."""

    record: dict | None
    exists: bool
    version: str | None


class _Lease:
    """This process's hold of one URL's run lease, renewed by a daemon thread."""

    def __init__(self, storage: FsspecBackend, record: dict, seconds: float, version: str | None) -> None:
        self.pid, self.record, self.seconds, self.version = os.getpid(), record, seconds, version
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
                version = _write(storage, record, create=not found.exists, version=found.version)
                break
            except PreconditionFailed:  # written by another claimant since the read: read the winner's lease
                continue
        else:
            raise JobConflictError(f"the run lease {storage.root}/{LEASE} changed under each of {_ATTEMPTS} claims "
                                   "(other runs are claiming this URL); give this run another checkpoint URL")
        _LEASES[storage.root] = _Lease(storage, record, seconds, version)


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
            _delete(storage, found.version)
    except PreconditionFailed:
        pass  # taken over since the read: not this run's to delete
    except CheckpointError as exc:
        log.warning("could not remove the run lease (it expires by itself): %s", exc)


def _conditional(storage: FsspecBackend) -> ConditionalObject | None:
    """The lease object's conditional writes, or None where the lease is advisory (logged once per URL)."""
    if storage.root in _ADVISORY:
        return None
    writes = conditional_object(storage.fs, storage.key(LEASE), f"{storage.root}/{LEASE}")
    if writes is None:
        _advisory(storage, "the store has no conditional writes")
    return writes


def _advisory(storage: FsspecBackend, why: str) -> None:
    if storage.root not in _ADVISORY:
        _ADVISORY.add(storage.root)
        log.warning("the run lease %s/%s is advisory (%s): two runs started at the same instant may both claim "
                    "it; give each run its own checkpoint URL", storage.root, LEASE, why)


def _write(storage: FsspecBackend, record: dict, *, create: bool, version: str | None) -> str | None:
    """Write ``record`` with a fresh heartbeat, where the store has conditional writes only if
    the lease is absent (``create``) or still at ``version``; its new version, or None when
    written unconditionally."""
    body = json.dumps({**record, "heartbeat_at": time.time()}).encode()
    writes = _conditional(storage)
    if writes is not None and (create or version is not None):
        try:
            return writes.create(body) if create else writes.replace(body, version)
        except NotImplementedError as exc:
            _advisory(storage, f"the server refused a conditional write: {exc}")
    storage.write(LEASE, memoryview(body))
    return None


def _delete(storage: FsspecBackend, version: str | None) -> None:
    writes = _conditional(storage)
    if writes is not None and version is not None:
        try:
            writes.delete(version)
            return
        except NotImplementedError:
            pass  # a conditional delete is newer than conditional writes: delete as read
    storage.delete([LEASE])


def _read(storage: FsspecBackend) -> _Found:
    """The lease as it is now, with the version of the very bytes read where the store has one."""
    writes = _conditional(storage)
    try:
        raw, version = writes.read(MAX_MARKER) if writes else (storage.read_small(LEASE, MAX_MARKER), None)
    except CheckpointNotFoundError:
        return _Found(None, False, None)
    try:
        if len(raw) > MAX_MARKER:
            raise CorruptCheckpointError(f"larger than {MAX_MARKER} bytes")
        lease = json.loads(raw)
    except (ValueError, CorruptCheckpointError) as exc:
        log.warning("ignoring the unreadable run lease %s/%s: %s", storage.root, LEASE, exc)
        return _Found(None, True, version)
    return _Found(lease if isinstance(lease, dict) else None, True, version)


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
    if lease.version is None:  # advisory: look before writing
        there = _read(storage).record
        if there is not None and there.get("token") != lease.record["token"]:
            return _taken_over(storage, lease, there)
    try:
        lease.version = _write(storage, lease.record, create=False, version=lease.version)
        return True
    except PreconditionFailed:
        found = _read(storage)
        if found.record is not None and (found.record.get("token"), found.record.get("pid")) == (
                lease.record["token"], lease.pid):
            lease.version = found.version  # our own write, answered late (a client retry): still ours
            return True
        return _taken_over(storage, lease, found.record or {})


def _taken_over(storage: FsspecBackend, lease: _Lease, there: dict) -> bool:
    log.error("the run lease %s/%s was taken over: %s; no longer renewing it", storage.root, LEASE,
              _conflict(storage, there, lease.seconds))
    return False
