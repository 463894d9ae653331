"""One live run per object-store URL: a run lease instead of ``flock``.

Object stores have no locks that die with their holder. Rank 0 of a run writes
``<url>/.flashckpt-run.json`` (its token, host, pid, ``TORCHELASTIC_RUN_ID``, and a
heartbeat time) and a daemon thread rewrites it every quarter of ``lease_seconds``. A
lease of another run counts as live while its heartbeat is younger than
``lease_seconds`` (clocks assumed within a few seconds of each other), unless its pid is
dead on this host or it carries this job's ``TORCHELASTIC_RUN_ID`` (a restart of the
same job); a live lease is a :class:`JobConflictError` naming its pid and host.
Trade-offs: a run that died on another host blocks the URL for up to ``lease_seconds``
(60 s); two runs claiming in the same instant may both succeed (no conditional writes
are assumed of the store), after which each heartbeat notices the other's token and the
run that lost stops renewing with an error logged.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING

from ._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, JobConflictError
from ._slot import pid_alive
from ._storage import _MAX_MARKER

if TYPE_CHECKING:
    from ._object_storage import ObjectStorage

__all__ = ["LEASE", "LEASE_SECONDS", "claim", "release"]

log = logging.getLogger(__name__)

LEASE = ".flashckpt-run.json"
LEASE_SECONDS = 60.0
"""A run lease not renewed for this long belongs to a dead run."""


class _Lease:
    """This process's hold of one URL's run lease, renewed by a daemon thread."""

    def __init__(self, storage: ObjectStorage, record: dict, seconds: float) -> None:
        self.pid, self.record, self.seconds = os.getpid(), record, seconds
        self.holders: weakref.WeakSet[ObjectStorage] = weakref.WeakSet([storage])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_renew, args=(storage, self), name="flashckpt-lease", daemon=True)
        self.thread.start()


_LEASES: dict[str, _Lease] = {}
_GUARD = threading.Lock()


def claim(storage: ObjectStorage, token: str, seconds: float) -> None:
    """Hold ``storage``'s run lease for run ``token`` (see the module docstring)."""
    with _GUARD:
        held = _LEASES.get(storage.root)
        if held is not None and held.pid == os.getpid():
            held.holders.add(storage)
            return
        other = _read(storage)
        if other is not None and other.get("token") != token and _live(other, seconds):
            raise JobConflictError(_conflict(storage, other, seconds))
        record = {"token": token, "host": socket.gethostname(), "pid": os.getpid(),
                  "run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""), "started_at": time.time()}
        storage._put_small(LEASE, json.dumps({**record, "heartbeat_at": time.time()}).encode())
        _LEASES[storage.root] = _Lease(storage, record, seconds)


def release(storage: ObjectStorage) -> None:
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
        there = _read(storage)
        if there is not None and there.get("token") == held.record["token"]:
            storage._delete([LEASE])
    except CheckpointError as exc:
        log.warning("could not remove the run lease (it expires by itself): %s", exc)


def _read(storage: ObjectStorage) -> dict | None:
    try:
        lease = json.loads(storage._read_small(LEASE, _MAX_MARKER))
    except CheckpointNotFoundError:
        return None
    except (ValueError, CorruptCheckpointError) as exc:
        log.warning("ignoring the unreadable run lease %s/%s: %s", storage.root, LEASE, exc)
        return None
    return lease if isinstance(lease, dict) else None


def _live(lease: dict, seconds: float) -> bool:
    try:
        age = time.time() - float(lease["heartbeat_at"])
        pid, host, run_id = int(lease["pid"]), str(lease["host"]), str(lease.get("run_id", ""))
    except (KeyError, TypeError, ValueError):
        return False
    if age > seconds or (run_id and run_id == os.environ.get("TORCHELASTIC_RUN_ID")):
        return False
    return not (host == socket.gethostname() and not pid_alive(pid))


def _conflict(storage: ObjectStorage, lease: dict, seconds: float) -> str:
    return (f"another run is live in {storage.root}: pid {str(lease.get('pid'))[:20]} on host "
            f"{str(lease.get('host'))[:255]} renewed {LEASE} within the last {seconds:.0f}s; stop it, or give "
            "this run another checkpoint URL")


def _renew(storage: ObjectStorage, lease: _Lease) -> None:
    """Renew ``lease`` until stopped, or until another run took the lease over."""
    while not lease.stop.wait(lease.seconds / 4):
        try:
            there = _read(storage)
            if there is not None and there.get("token") != lease.record["token"]:
                log.error("the run lease %s/%s was taken over: %s; no longer renewing it", storage.root, LEASE,
                          _conflict(storage, there, lease.seconds))
                return
            storage._put_small(LEASE, json.dumps({**lease.record, "heartbeat_at": time.time()}).encode())
        except CheckpointError as exc:
            log.warning("renewing the run lease failed (retrying): %s", exc)
