"""The :class:`~flashckpt.storage._protocol.Backend` primitives over a local directory.

Objects are files below the directory, named by ``/``-joined plain names. Every read
walks the name one directory at a time without following a symlink (a step directory
that is a link is refused, not followed out of the checkpoint directory) and opens only
a regular file, bounded; a write goes to a new temporary file, is fsynced and renamed
over its name (atomic), and the directory is fsynced. The run lease is the directory's
``flock`` (:class:`~flashckpt.storage._run_lock.RunClaim`).

:class:`~flashckpt.storage._local.LocalStorage` reads and writes its small objects
(metadata, markers, ``latest``) and claims its run through these primitives; its
shards and its commit by rename stay its own (``O_DIRECT`` writes, a pending directory
renamed into place).
"""

from __future__ import annotations

import errno
import io
import os
import stat
from typing import Callable

from .._errors import CheckpointError, CheckpointNotFoundError, UnsafeFileError
from ._files import open_regular, read_bounded, write_atomic
from ._pending import DIR_FLAGS
from ._protocol import ObjectInfo
from ._run_lock import RunClaim

__all__ = ["DirectoryBackend"]

_PART = ".tmp-"
"""A file or directory being written (or retired) has this in its name: never listed."""


class DirectoryBackend:
    """Objects as files below the directory ``root``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._claim = RunClaim(root)

    def path(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/"))

    def open_dir(self, name: str) -> int:
        """A descriptor of the directory ``name`` ("" for the root), reached without following
        a symlink: :class:`CheckpointNotFoundError` if missing, :class:`UnsafeFileError` if a
        part of it is a link or not a directory."""
        try:  # the directory itself may be a link (a user's choice of where it lives); nothing below it
            fd = os.open(self.root, DIR_FLAGS & ~os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(f"{self.root} does not exist") from None
        for part in [p for p in name.split("/") if p]:
            try:
                inner = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{self.path(name)} does not exist") from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeFileError(f"{self.path(name)} is a symbolic link or not a directory; directories "
                                          "are never followed out of the checkpoint directory") from None
                raise CheckpointError(f"cannot open {self.path(name)}: {exc.strerror}") from exc
            finally:
                os.close(fd)
            fd = inner
        return fd

    def open_file(self, name: str) -> int:
        """A descriptor of the regular file ``name`` (see :meth:`open_dir`, and
        :func:`~flashckpt.storage._files.open_regular` for the file itself)."""
        parent, _, base = name.rpartition("/")
        dir_fd = self.open_dir(parent)
        try:
            return open_regular(base, self.path(name), dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    # -- the Backend primitives -------------------------------------------------------

    def write(self, name: str, data: memoryview | bytes) -> None:
        path = self.path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, data)

    def read_small(self, name: str, limit: int) -> bytes:
        fd = self.open_file(name)
        try:
            return read_bounded(fd, limit, self.path(name))
        finally:
            os.close(fd)

    def read_many(self, names: list[str]) -> dict[str, bytes | Exception]:
        found: dict[str, bytes | Exception] = {}
        for name in names:
            try:
                found[name] = self.read_small(name, 1 << 20)
            except CheckpointError as exc:
                found[name] = exc
        return found

    def open_range(self, name: str, size: int) -> io.FileIO:
        f = io.FileIO(self.open_file(name), "rb", closefd=True)
        f.name = self.path(name)
        return f

    def size(self, name: str) -> int:
        fd = self.open_file(name)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def list(self, under: str = "") -> dict[str, ObjectInfo]:
        found = {}
        for top, dirs, files in os.walk(self.path(under) if under else self.root):
            dirs[:] = [d for d in dirs if _PART not in d]
            for file in files:
                where = os.path.join(top, file)
                st = os.lstat(where)
                if _PART not in file and stat.S_ISREG(st.st_mode):
                    found[os.path.relpath(where, self.root).replace(os.sep, "/")] = ObjectInfo(
                        st.st_size, (st.st_ino, st.st_mtime_ns, st.st_size))
        return found

    def delete(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(self.path(name))
            except FileNotFoundError:
                pass

    def claim(self, token: str) -> None:
        self._claim.take(token)

    def release(self) -> None:
        self._claim.release()

    def sweep(self, stale: Callable[[str], bool]) -> None:
        """Nothing: a half-written file keeps its temporary name, which is never listed."""
