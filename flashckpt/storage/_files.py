"""Durable writes and safe, bounded reads of single files.

Reads open only regular files (never through a symlink, never blocking on a FIFO or a
device) and read a bounded number of bytes; writes go to new files (never through a
symlink), are fsynced, and replace their target atomically where asked.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import uuid

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsafeFileError

__all__ = ["fsync_dir", "open_regular", "read_bounded", "write_atomic", "write_durable"]

_CHUNK = 64 << 20
_DIRECT_ALIGN = 4096
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_regular(name: str, where: str, *, dir_fd: int | None = None) -> int:
    """Open a regular file for reading without following a symlink and without blocking
    on a FIFO or device; ``where`` names it in errors (a path inside the directory)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{where} is a symbolic link; only regular files inside the checkpoint "
                                  "directory are read") from None
        raise CheckpointError(f"cannot open {where}: {exc.strerror}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFileError(f"{where} is not a regular file (a FIFO, device or directory); refusing to read it")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(fd: int, limit: int, where: str) -> bytes:
    """All of a file's bytes, or a :class:`CorruptCheckpointError` past ``limit`` bytes."""
    if os.fstat(fd).st_size > limit:
        raise CorruptCheckpointError(f"{where} is larger than {limit} bytes; refusing to read it")
    parts, total = [], 0
    while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise CorruptCheckpointError(f"{where} is larger than {limit} bytes; refusing to read it")
    return b"".join(parts)


def write_durable(path: str, data: memoryview) -> None:
    """Write ``data`` to a new file and fsync it; ``O_DIRECT`` for the aligned part when
    the file system and the buffer allow it, buffered for the rest."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError as exc:  # tmpfs and some network file systems refuse O_DIRECT
        if exc.errno == errno.ELOOP:
            raise
        fd = os.open(path, flags, 0o644)
    try:
        done = 0
        direct_end = len(data) - len(data) % _DIRECT_ALIGN
        while done < len(data):
            if done >= direct_end:
                _buffered(fd)
            end = min(done + _CHUNK, direct_end if done < direct_end else len(data))
            try:
                done += os.write(fd, data[done:end])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not _buffered(fd):
                    raise
        os.fsync(fd)
    finally:
        os.close(fd)


def _buffered(fd: int) -> bool:
    """Turn off O_DIRECT on ``fd``; False if it was not on."""
    direct = getattr(os, "O_DIRECT", 0)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & direct:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~direct)
    return True


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data``: a new temp file (never through a symlink), fsync,
    rename, fsync the directory."""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path))
