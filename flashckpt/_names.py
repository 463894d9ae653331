"""Names of the shared-memory objects of a job on this node.

Everything a job keeps in shared memory lives under one prefix,
``/dev/shm/flashckpt.<user>.<job_id>``, so that ``flashckpt gc`` and the saver can
find a job's objects by listing one directory. Segments are created 0600.
"""

from __future__ import annotations

import hashlib
import os
import pwd

__all__ = ["SHM_DIR", "default_job_id", "job_prefix", "lock_path", "slot_path", "socket_path"]

SHM_DIR = os.environ.get("FLASHCKPT_SHM_DIR", "/dev/shm")


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def default_job_id(directory: str) -> str:
    """A job id that every process of a run derives alike: a hash of the checkpoint
    directory, so restarts under any launcher find the same shared memory."""
    digest = hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()
    return digest[:16]


def job_prefix(job_id: str) -> str:
    """The path prefix of every shared-memory object of ``job_id`` on this node."""
    if not job_id or "/" in job_id or "." in job_id:
        raise ValueError(f"job_id must be a non-empty name without '/' or '.', got {job_id!r}")
    return os.path.join(SHM_DIR, f"flashckpt.{_user()}.{job_id}")


def slot_path(job_id: str, local_rank: int, slot: int) -> str:
    return f"{job_prefix(job_id)}.rank{local_rank}.slot{slot}"


def lock_path(slot: str) -> str:
    """The lock file guarding the headers of a slot's rank (shared by its two slots)."""
    return slot.rsplit(".slot", 1)[0] + ".lock"


def socket_path(job_id: str) -> str:
    return f"{job_prefix(job_id)}.sock"
