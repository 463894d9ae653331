"""Memory copies with non-temporal (streaming) stores, for the large host copies of a save.

A save copies the state once into shared memory, and nothing reads that copy back while
it could still be in a cache. A normal store first reads the destination's cache line
(read for ownership) and then evicts it, so it moves each byte three times; a streaming
store writes the line without reading it. glibc's ``memmove`` streams only above its
``x86_non_temporal_threshold`` (240 MiB on the 2-core development machine), far above
any one tensor. There, two threads copy a GPT-2 AdamW state (1.49 GB) into shared
memory in 69 ms with streaming stores against 101 ms with ``memmove``.

Neither Python, numpy nor torch has such a copy, so on x86-64 Linux this module puts a
small SSE2 loop (``movdqu`` loads, ``movntdq`` stores, then ``sfence``, so the copy is
visible to other processes once it returns) in a page of its own: the page is written
while it is read-write, then made read+execute, never both at once. ctypes calls it with
the GIL released. On other CPUs or systems, where that page cannot be made executable
(an SELinux ``execmem`` policy), for overlapping ranges, or with
``FLASHCKPT_STREAMING_COPY=0``, the copy is ``memmove``. Loads from memory stream too:
their targets are about to be read, but a state that size does not stay cached anyway.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import platform
import struct
import sys
from collections.abc import Callable

__all__ = ["STREAM_MIN_BYTES", "stream_copy", "streaming"]

log = logging.getLogger(__name__)

STREAM_MIN_BYTES = 256 << 10
"""Copies shorter than this use ``memmove``: they fit in the caches, where a normal store is as fast."""

_BLOCK = 64  # bytes the loop moves an iteration
_ALIGN = 16  # movntdq stores to 16-byte aligned addresses

# void body(void *dst, const void *src, size_t n): dst 16-byte aligned, n a positive multiple of 64.
# System V ABI: rdi = dst, rsi = src, rdx = n.
_LOOP = bytes.fromhex(
    "f30f6f06"    # movdqu  xmm0, [rsi]
    "f30f6f4e10"  # movdqu  xmm1, [rsi+16]
    "f30f6f5620"  # movdqu  xmm2, [rsi+32]
    "f30f6f5e30"  # movdqu  xmm3, [rsi+48]
    "660fe707"    # movntdq [rdi], xmm0
    "660fe74f10"  # movntdq [rdi+16], xmm1
    "660fe75720"  # movntdq [rdi+32], xmm2
    "660fe75f30"  # movntdq [rdi+48], xmm3
    "4883c640"    # add     rsi, 64
    "4883c740"    # add     rdi, 64
    "4883ea40"    # sub     rdx, 64
)
_CODE = _LOOP + b"\x75" + struct.pack("b", -(len(_LOOP) + 2)) + bytes.fromhex(
    "0faef8"  # sfence
    "c3"      # ret
)  # jnz back to the first movdqu

_Body = Callable[[int, int, int], None]


def _load_body() -> _Body | None:
    """The streaming loop, callable through ctypes; None where it cannot run here."""
    if os.environ.get("FLASHCKPT_STREAMING_COPY", "1").strip() == "0":
        return None
    if (not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64")
            or ctypes.sizeof(ctypes.c_void_p) != 8):  # a 32-bit Python on a 64-bit kernel runs no 64-bit code
        return None
    try:
        return _map_body()
    except (OSError, AttributeError) as exc:  # no libc, or no mmap/mprotect in it
        log.debug("streaming copy unavailable: %s", exc)
        return None


def _map_body() -> _Body | None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if page in (None, ctypes.c_void_p(-1).value):
        log.debug("streaming copy unavailable: mmap failed (errno %d)", ctypes.get_errno())
        return None
    ctypes.memmove(page, _CODE, len(_CODE))
    if libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        log.debug("streaming copy unavailable: the page cannot be made executable (errno %d)", ctypes.get_errno())
        libc.munmap(page, mmap.PAGESIZE)
        return None
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(page)


@functools.cache
def _stream_body() -> _Body | None:
    """The loop, mapped at the first large copy (two threads that race there map a page
    each, and one is kept: harmless)."""
    return _load_body()


def streaming() -> bool:
    """Whether large copies in this process use streaming stores."""
    return _stream_body() is not None


def stream_copy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to address ``dst``, with streaming stores when
    the copy is large and the ranges do not overlap. Both ranges must be valid for the call."""
    body = _stream_body() if nbytes >= STREAM_MIN_BYTES else None
    head = -dst % _ALIGN
    whole = (nbytes - head) // _BLOCK * _BLOCK
    if body is None or whole <= 0 or (dst < src + nbytes and src < dst + nbytes):
        ctypes.memmove(dst, src, nbytes)
        return
    if head:
        ctypes.memmove(dst, src, head)
    body(dst + head, src + head, whole)
    tail = nbytes - head - whole
    if tail:
        ctypes.memmove(dst + head + whole, src + head + whole, tail)
