"""The file side of reading a shard: exact positional reads, the header's read, and
what the kernel says about the file.

- :func:`pieces_reader`: ``read(pieces, offset)`` that fills buffers with a local file's
  consecutive bytes (``preadv``, resumed after short reads) or an object store's shard's;
  a file shorter than its commit recorded is a :class:`CorruptCheckpointError`.
- :func:`read_image_header` and :func:`file_header`: the one way a shard's header is read
  (its first bytes, the rest if longer) and parsed, held to safetensors' own rules
  (:func:`~flashckpt.memory._format.parse_header`) against the shard's whole size.
- :func:`read_streams`: how many reads of a local file to run at once (one on a
  rotational disk); :func:`resident_pages` and :func:`mostly_cached`: which pages of a
  file the page cache holds, so a load leaves cached only what was cached before.
"""

from __future__ import annotations

import ctypes
import functools
import io
import mmap
import os
from typing import Any, Callable

from .._errors import CorruptCheckpointError
from .._options import env_count
from ..memory._format import Image, header_length, parse_header

__all__ = ["READ_THREADS_ENV", "THREADS", "file_header", "mostly_cached", "pieces_reader", "read_image_header",
           "read_streams", "resident_pages"]

THREADS = 8
"""Threads of a full read from storage other than a rotational disk: enough outstanding
reads to keep a fast device (or an object store) busy."""
READ_THREADS_ENV = "FLASHCKPT_READ_THREADS"
_FIRST_READ = 64 << 10
_IOV_MAX = 1024
_LOW_BIT = bytes(b & 1 for b in range(256))
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]

Read = Callable[[list[memoryview], int], None]
"""``read(pieces, offset)``: fill ``pieces`` with consecutive bytes from ``offset``, exactly."""


def read_streams(device: int, sys_root: str = "/sys") -> int:
    """How many reads of a local file on ``device`` (``st_dev``) a rank runs at once:
    ``FLASHCKPT_READ_THREADS``, else 1 on a disk the kernel marks rotational, else
    :data:`THREADS`. On a rotational disk (or a virtual one that says so) streams seek
    against each other: a resharded FSDP load 4 -> 2 measured 0.28 s with one read per
    rank against 0.35 s with eight, and a one-process load as fast with one as with eight."""
    return env_count(READ_THREADS_ENV, 1 if _rotational(device, sys_root) else THREADS)


@functools.lru_cache(maxsize=64)
def _rotational(device: int, sys_root: str) -> bool:
    """Whether block device ``device`` (a partition: its disk) is rotational; False where
    there is no block device (tmpfs, NFS, overlay) or sysfs would not say."""
    node = os.path.realpath(os.path.join(sys_root, "dev", "block", f"{os.major(device)}:{os.minor(device)}"))
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.dirname(node)
    try:
        with open(os.path.join(node, "queue", "rotational")) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def pieces_reader(file: Any, path: str, size: int) -> Read:
    """The :data:`Read` of ``file``: a local file's through ``preadv`` (an object store's
    shard, or an image in memory, brings its own ``preadv``)."""
    if not isinstance(file, io.FileIO):
        return file.preadv
    fd = file.fileno()

    def read(pieces: list[memoryview], offset: int) -> None:
        pending = [p for p in pieces if len(p)]
        while pending:
            n = os.preadv(fd, pending[:_IOV_MAX], offset)
            if n <= 0:
                raise CorruptCheckpointError(f"{path}: truncated at byte {offset} (the commit recorded {size} bytes)")
            offset += n
            while n and n >= len(pending[0]):
                n -= len(pending.pop(0))
            if n:
                pending[0] = pending[0][n:]

    return read


def read_image_header(read: Read, where: str, size: int) -> Image:
    """The parsed and checked header of the ``size``-byte image that ``read`` reads: its
    first bytes, the rest if the header is longer."""
    def read_bytes(offset: int, n: int) -> bytes:
        buf = bytearray(max(0, min(n, size - offset)))
        read([memoryview(buf)], offset)
        return bytes(buf)

    head = read_bytes(0, min(_FIRST_READ, size))
    n = header_length(head, where)
    if 8 + n > len(head) and 8 + n <= size:
        head += read_bytes(len(head), 8 + n - len(head))
    return parse_header(head, where, size)


def file_header(file: Any, size: int) -> Image:
    """The parsed and checked header of an open shard of ``size`` bytes (a local file or
    an object store's shard)."""
    return read_image_header(pieces_reader(file, str(file.name), size), str(file.name), size)


def mostly_cached(pages: bytes, start: int, length: int) -> bool:
    """Whether at least half of the pages of ``[start, start + length)`` are marked in ``pages``."""
    touched = pages[start // mmap.PAGESIZE:-(-(start + length) // mmap.PAGESIZE)]
    return 2 * (len(touched) - touched.count(0)) >= len(touched)


def resident_pages(fd: int, size: int) -> bytes | None:
    """One byte per page of the file, nonzero where the page is in the page cache
    (``mincore`` over a mapping of it); None where that cannot be learnt."""
    if size == 0:
        return b""
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        if _libc.mincore(addr, size, vec) != 0:
            return None
        return vec.raw.translate(_LOW_BIT)
    finally:
        _libc.munmap(addr, size)
