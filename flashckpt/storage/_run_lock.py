"""One live run per checkpoint directory.

The run writing a directory holds an ``flock`` on ``<dir>/.flashckpt-run.lock``, which
records its pid and host for the error a second run gets. The kernel releases the lock
when the process dies, so a crashed run never blocks its restart. Claims are counted
per process: a second checkpointer of the same run in the same process shares the lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time

from .._errors import CheckpointError, JobConflictError, UnsafeFileError

__all__ = ["RUN_LOCK", "RunClaim", "holder"]

RUN_LOCK = ".flashckpt-run.lock"


class _Held:
    """This process's hold of one directory's run lock."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pid, self.count = fd, os.getpid(), 1


_HELD: dict[str, _Held] = {}
_HELD_GUARD = threading.Lock()


class RunClaim:
    """One object's claim on the run lock of directory ``root``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._claimed = False

    def take(self, token: str) -> None:
        """Hold the lock for run ``token`` until :meth:`release` or exit.

        Raises :class:`JobConflictError` naming the other process's pid and host when a
        live process of another run holds it. Taking it again from the same process (a
        second checkpointer) succeeds.
        """
        with _HELD_GUARD:
            held = _HELD.get(self.root)
            if held is not None and held.pid == os.getpid():
                if not self._claimed:
                    held.count += 1
                    self._claimed = True
                return
            where = os.path.join(self.root, RUN_LOCK)
            try:
                os.makedirs(self.root, exist_ok=True)
                fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafeFileError(f"{where} is a symbolic link; refusing to use it") from None
                raise CheckpointError(f"cannot open {where}: {exc.strerror}") from exc
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise UnsafeFileError(f"{where} is not a regular file; refusing to use it")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise JobConflictError(self._conflict(fd)) from None
                record = {"pid": os.getpid(), "host": socket.gethostname(), "token": token,
                          "started_at": time.time()}
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
            except BaseException:
                os.close(fd)
                raise
            _HELD[self.root] = _Held(fd)
            self._claimed = True

    def _conflict(self, fd: int) -> str:
        try:
            other = json.loads(os.pread(fd, 4096, 0))
            pid, host = int(other["pid"]), str(other["host"])[:255]
            who = f"pid {pid} on host {host}"
        except (OSError, ValueError, TypeError, KeyError):
            who = "a process that has not yet written its pid"
        return (f"another run is live in {self.root}: {who} holds {RUN_LOCK}; stop it, or give this run "
                "another checkpoint directory")

    def release(self) -> None:
        """Give up this claim; the lock is released when the process's last claim goes."""
        with _HELD_GUARD:
            if not self._claimed:
                return
            self._claimed = False
            held = _HELD.get(self.root)
            if held is None or held.pid != os.getpid():
                return
            held.count -= 1
            if held.count == 0:
                del _HELD[self.root]
                try:
                    os.ftruncate(held.fd, 0)
                except OSError:
                    pass
                os.close(held.fd)


def holder(root: str) -> dict[str, object] | None:
    """``{"pid", "host"}`` of another process holding ``root``'s run lock now, else None
    (free, or held by this process); takes nothing."""
    with _HELD_GUARD:
        held = _HELD.get(root)
        if held is not None and held.pid == os.getpid():
            return None
    try:
        fd = os.open(os.path.join(root, RUN_LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file yet (or an unsafe one, refused when the run claims it)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                record = json.loads(os.pread(fd, 4096, 0))
                return {"pid": int(record["pid"]), "host": str(record["host"])[:255]}
            except (OSError, ValueError, TypeError, KeyError):
                return {"pid": 0, "host": ""}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
