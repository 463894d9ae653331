"""Names of the shared-memory objects of a job on this node.

Everything a job keeps in shared memory (slots, rank locks, the saver's socket, lock
and log, progress files) lives in one private directory per user,
``<shm>/flashckpt-<uid>`` (``<shm>`` is ``/dev/shm`` or ``FLASHCKPT_SHM_DIR``), created
0700 and checked before every use: owned by this user, mode 0700, not a symlink. No other
local user can create, replace, read or connect to anything in it, so predictable names
inside it are safe. A job's objects share the prefix ``<private dir>/<job_id>``.
"""

from __future__ import annotations

import hashlib
import os
import stat
from contextlib import contextmanager
from typing import Iterator

from ._errors import UnsafeFileError

__all__ = ["SHM_DIR", "default_job_id", "job_objects", "job_prefix", "lock_path", "private_dir",
           "replica_path", "saver_log_path", "slot_path", "socket_path", "unix_address", "watchdog_log_path"]

SHM_DIR = os.environ.get("FLASHCKPT_SHM_DIR", "/dev/shm")


def private_dir() -> str:
    """This user's private directory of shared-memory objects, created 0700 if missing.

    Raises :class:`UnsafeFileError` if the path is a symlink, not a directory, owned by
    another user, or open to others: another user may have planted it.
    """
    path = os.path.join(SHM_DIR, f"flashckpt-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeFileError(f"cannot create the private shared-memory directory {path}: {exc}") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFileError(f"{path} is not a directory (a symlink or file planted there?); remove it")
    if st.st_uid != os.getuid():
        raise UnsafeFileError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
                              f"remove it, or set FLASHCKPT_SHM_DIR to another tmpfs")
    if st.st_mode & 0o077:
        raise UnsafeFileError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); "
                              f"chmod 700 it or remove it")
    return path


def default_job_id(directory: str) -> str:
    """A job id that every process of a run derives alike: a hash of the checkpoint
    directory, so restarts under any launcher find the same shared memory."""
    where = directory if "://" in directory else os.path.abspath(directory)  # a URL is the same everywhere
    digest = hashlib.sha1(where.encode()).hexdigest()
    return digest[:16]


def check_job_id(job_id: str) -> None:
    if not job_id or "/" in job_id or "." in job_id or job_id.startswith("-"):
        raise ValueError(f"job_id must be a non-empty name without '/' or '.', got {job_id!r}")


def job_prefix(job_id: str) -> str:
    """The path prefix of every shared-memory object of ``job_id`` on this node."""
    check_job_id(job_id)
    return os.path.join(private_dir(), job_id)


def job_objects(job_id: str) -> list[str]:
    """Every shared-memory object of ``job_id`` on this node (slots, locks, socket, log...)."""
    prefix = job_prefix(job_id) + "."
    directory = os.path.dirname(prefix)
    return sorted(os.path.join(directory, name) for name in os.listdir(directory)
                  if os.path.join(directory, name).startswith(prefix))


def slot_path(job_id: str, local_rank: int, slot: int) -> str:
    return f"{job_prefix(job_id)}.rank{local_rank}.slot{slot}"


def replica_path(job_id: str, storage_rank: int, copy: int) -> str:
    """One of the two copies this node keeps of storage rank ``storage_rank``'s replica
    (state of a rank on another node); its lock is ``lock_path`` of it, as for a slot."""
    return f"{job_prefix(job_id)}.replica{storage_rank}.slot{copy}"


def lock_path(slot: str) -> str:
    """The lock file guarding the headers of a slot's rank (shared by its two slots)."""
    return slot.rsplit(".slot", 1)[0] + ".lock"


def socket_path(job_id: str) -> str:
    return f"{job_prefix(job_id)}.sock"


_SUN_PATH_MAX = 107
"""The longest path an AF_UNIX address holds (``sun_path`` is 108 bytes with its NUL)."""


@contextmanager
def unix_address(path: str) -> Iterator[str]:
    """``path`` as an AF_UNIX address to bind or connect to while the block runs: the path
    itself where it fits, else the same file through a descriptor of its directory
    (``/proc/self/fd/N/<name>``), so a deep ``FLASHCKPT_SHM_DIR`` works too."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield path
        return
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


def saver_log_path(job_id: str) -> str:
    """The saver's log (size-capped) in the private directory; kept after the job's
    shared memory is freed, removed by ``flashckpt gc`` once the job is gone."""
    return f"{job_prefix(job_id)}-saver.log"


def watchdog_log_path(job_id: str) -> str:
    """The hang watcher's log, beside the saver's."""
    return f"{job_prefix(job_id)}-watchdog.log"
