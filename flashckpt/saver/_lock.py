"""Which saver serves a job on this node: the one holding the ``flock`` on the file at
``<job>.saver.lock``.

A lock on a file that was removed or replaced (a wiped ``/dev/shm``, a cleanup script)
is no longer the job's lock: a trainer that finds no socket starts a new saver, which
locks the new file. The old holder checks every tick whether the path still names the
file it locked, takes the path again if nobody else has, and otherwise steps down.
"""

from __future__ import annotations

import fcntl
import os

from .. import _names
from ..memory._slot import open_private
from ._wire import process_state

__all__ = ["ServingLock", "lock_holder", "stopped_saver"]


class ServingLock:
    """The lock that makes one saver per job and node the one that listens."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1

    def take(self) -> bool:
        """Lock the file at :attr:`path` (created if missing) and write this pid into it;
        False if another process holds it. A file removed or replaced between opening and
        locking is opened again, so the lock taken is always the one the path names."""
        while True:
            fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
            assert fd is not None  # O_CREAT
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            if self._names(fd):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who serves, for the trainers' error messages
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        return True

    def held(self) -> bool:
        """Whether this process holds the lock the path names now."""
        return self._fd >= 0 and self._names(self._fd)

    def release(self) -> None:
        """Remove the lock file if it is still this process's, and unlock."""
        if self._fd < 0:
            return
        if self.held():
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1

    def _names(self, fd: int) -> bool:
        """Whether the lock path names the file open as ``fd``."""
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def stopped_saver(job_id: str) -> int:
    """The pid of this job's saver if it is stopped (``kill -STOP``, a debugger), else 0: the
    pid in its lock file, when that process is stopped and runs this job's saver (a pid
    reused by another process is not)."""
    holder = lock_holder(job_id)
    if not holder or process_state(holder) != "stopped":
        return 0
    try:
        with open(f"/proc/{holder}/cmdline", "rb") as f:
            argv = f.read(4096).split(b"\0")
    except OSError:
        return 0
    return holder if b"flashckpt.saver._saver" in argv and job_id.encode() in argv else 0


def lock_holder(job_id: str) -> int:
    """The pid the running saver wrote into its lock file (0 if unknown)."""
    try:
        with open(_names.job_prefix(job_id) + ".saver.lock", "rb") as f:
            return int(f.read(32).strip() or 0)
    except (OSError, ValueError):
        return 0
