"""Pending step directories of a local checkpoint directory: held while written, retired when dead.

A save writes its shard into ``step-<N>.tmp-<token>`` and holds that directory with a
shared ``flock`` while it writes; the kernel lets go when the writer dies. A commit (and
``flashckpt gc DIR``) retires the pending directories the newest commit supersedes
(:func:`~flashckpt.storage._policy.superseded`) that no writer holds, and a write that
finds the disk full first gives way: it removes the dead pending saves its own step
supersedes, then tries once more.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
import uuid
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from .._errors import UnsafeFileError
from ._policy import superseded

__all__ = ["DIR_FLAGS", "PendingDirs", "enter_pending"]

log = logging.getLogger("flashckpt.storage._local")

_TMP_RE = re.compile(r"^step-(\d+)\.tmp-(.+)$")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def enter_pending(pending: str) -> tuple[bool, int]:
    """Make or open the pending directory and hold it for writing (a shared ``flock``):
    (created by this call, the held descriptor). A cleanup that retired it just before
    the hold is noticed (another inode there, or none) and a fresh one is made."""
    while True:
        created = False
        try:
            os.mkdir(pending, 0o755)
            created = True
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(pending).st_mode):
                raise UnsafeFileError(f"{pending} is not a directory; refusing to write into it") from None
        fd = os.open(pending, DIR_FLAGS)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.lstat(pending).st_ino == os.fstat(fd).st_ino:
                return created, fd
        except FileNotFoundError:
            pass
        os.close(fd)


class PendingDirs:
    """The pending-directory side of :class:`~flashckpt.storage._local.LocalStorage`."""

    root: str

    if TYPE_CHECKING:
        def _tmp_dir(self, step: int, token: str) -> str: ...

        def _commit_lock(self, *, blocking: bool = True) -> AbstractContextManager[bool]: ...

        def steps_in_order(self) -> list[int]: ...

        def metadata(self, step: int) -> dict: ...

    def _give_way(self, step: int, token: str) -> bool:
        """Remove the pending saves that step ``step`` of run ``token`` would supersede
        (older lines, older steps of its line) and no writer holds: a full disk, and the
        newer step needs their space more. Whether any went."""
        own = os.path.basename(self._tmp_dir(step, token))
        if not any(_TMP_RE.match(name) and name != own for name in os.listdir(self.root)):
            return False  # nothing to free: no lock file made on a full disk
        with self._commit_lock():
            gone = [path for path, live in self._sweep(token, step) if not live]
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
        if gone:
            log.warning("the disk of %s is full: removed %d older pending save(s) to write step %d",
                        self.root, len(gone), step)
        return bool(gone)

    def _sweep(self, token: str, step: int, *, dry_run: bool = False) -> list[tuple[str, bool]]:
        """Pending directories that step ``step`` of run ``token`` supersedes, and leftovers
        of deletes: (path, live). Dead ones are renamed to a retired name (the path given is
        that name), unless ``dry_run``; live ones (a writer holds them) are left. Caller
        holds the commit lock."""
        found = []
        for name in os.listdir(self.root):
            m = _TMP_RE.match(name)
            if m is None:
                continue
            path, other = os.path.join(self.root, name), m.group(2)
            if other.startswith(("replaced-", "retired-")):
                found.append((path, False))  # being deleted, or left by a crash mid-delete
            elif superseded(other, int(m.group(1)), token, step):
                found.append(self._retire_unheld(path, int(m.group(1)), dry_run))
                if found[-1][1]:
                    log.info("%s is being written by a live process: left to a later commit", path)
        return [(path, live) for path, live in found if path is not None]

    def _retire_unheld(self, path: str, step: int, dry_run: bool = False) -> tuple[str | None, bool]:
        """Retire the directory ``path`` unless a process holds it (an ``flock``: a writer of
        a pending save, an exporter reading a committed step): (its retired path, or ``path``
        with ``dry_run``, False), (path, True) when held, (None, False) when gone."""
        try:
            fd = os.open(path, DIR_FLAGS)
        except FileNotFoundError:
            return None, False
        except OSError:  # not a directory (or a symlink): nobody writes there
            return (path if dry_run else self._retire_path(path, step)), False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return path, True
            return (path if dry_run else self._retire_path(path, step)), False
        finally:
            os.close(fd)

    def remove_dead_pending(self, *, dry_run: bool = False) -> tuple[list[str], list[str]]:
        """Remove what the newest commit supersedes and no writer holds, as its next commit
        would (``flashckpt gc DIR``): (removed, or would be with ``dry_run``; kept because a
        live process writes them). Pending saves newer than every commit are left alone."""
        with self._commit_lock():
            order = self.steps_in_order()
            newest = (self.metadata(order[-1]).get("token") or "", order[-1]) if order else ("", -1)
            swept = self._sweep(*newest, dry_run=dry_run)
        dead = [path for path, live in swept if not live]
        if not dry_run:
            for path in dead:
                shutil.rmtree(path, ignore_errors=True)
        return dead, [path for path, live in swept if live]

    @staticmethod
    def _undo_write(pending: str, files: list[str], marker: str, created: bool) -> None:
        if os.path.lexists(marker):  # renamed into place before the failure: the shard it describes stays
            files = files[:1]
        for name in files:
            try:
                os.unlink(name)
            except OSError:
                pass
        if created:
            try:
                os.rmdir(pending)
            except OSError:
                pass

    def _retire_path(self, path: str, step: int) -> str | None:
        """``path`` renamed to a retired name; None if it is gone (a failed write undid itself)."""
        retired = os.path.join(self.root, f"step-{step}.tmp-retired-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(path, retired)
        except FileNotFoundError:
            return None
        return retired
