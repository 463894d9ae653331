"""Large host copies, split across a few threads.

A save blocks training for exactly one copy of the state, and one thread's memcpy does
not reach the machine's memory bandwidth: on the 2-core development machine one thread
copies TF variables into shared memory at 6-7 GiB/s, two or three threads at 8.5-9.5
(``benchmarks/tf_save.py``). The bytes to copy are cut into equal contiguous ranges,
one per thread: the caller's and the long-lived helpers a load reads on
(:func:`flashckpt.memory._workers.run_each`); the copies release the GIL. Small copies stay on the
calling thread (a hand-off costs more than it saves).

Two entry points: numpy array pairs (:func:`copy_arrays`), and plain address spans
(:func:`copy_spans`), which is how host torch tensors come here
(``flashckpt/torch/_tensors.py`` says why): building two numpy views of each tensor cost
14 us a tensor, 8 ms of a 1.49 GB save's stall. Large contiguous copies of either kind
use streaming stores (:mod:`flashckpt.memory._stream_copy`), smaller ones ``memmove``, which
aligns its stores whatever the offsets.

``FLASHCKPT_COPY_THREADS`` sets the number of threads (default: the CPUs this process
may run on, at most 4; 1 copies on the calling thread only).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, TypeVar

from . import _stream_copy
from .._options import env_count
from ._stream_copy import stream_copy
from ._workers import run_each

__all__ = ["PARALLEL_MIN_BYTES", "Span", "copy_arrays", "copy_spans", "copy_threads", "fewer_threads", "overlapping",
           "split_ranges", "split_spans"]

PARALLEL_MIN_BYTES = 16 << 20
"""Below this many bytes in all, one thread copies."""

_MAX_DEFAULT_THREADS = 4

Pair = tuple[Any, Any]
K = TypeVar("K")

Span = tuple[int, int, int]
"""``(destination address, source address, bytes)`` of one contiguous copy."""


_limit = threading.local()


def copy_threads() -> int:
    """Threads a large copy uses: ``FLASHCKPT_COPY_THREADS``, else the usable CPUs (at most 4);
    fewer inside :func:`fewer_threads`."""
    threads = env_count("FLASHCKPT_COPY_THREADS", max(1, min(_MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0)))))
    return min(threads, getattr(_limit, "threads", threads))


@contextmanager
def fewer_threads() -> Iterator[None]:
    """Copies made on this thread meanwhile use one thread fewer (at least one): an
    overlapped save's copy leaves a core to the training thread it runs beside."""
    _limit.threads = max(1, copy_threads() - 1)
    try:
        yield
    finally:
        del _limit.threads


def split_ranges(dsts: list[Any], srcs: list[Any], parts: int) -> list[list[Pair]]:
    """``(dst, src)`` pairs in at most ``parts`` groups of about equal bytes, in order.

    A pair of C-contiguous arrays of one dtype and shape is cut at element boundaries
    (flat views, no copy); any other pair (broadcast, strided) stays whole in one group.
    """
    total = sum(dst.nbytes for dst in dsts)
    share = max(1, -(-total // max(1, parts)))
    groups: list[list[Pair]] = [[]]
    room = share

    def room_left() -> int:
        """Bytes the current group still takes; opens the next group when it is full."""
        nonlocal room
        if room <= 0 and len(groups) < parts:
            groups.append([])
            room = share
        return room if len(groups) < parts else total  # the last group takes the rest

    for dst, src in zip(dsts, srcs):
        if (dst.shape != src.shape or dst.dtype != src.dtype or dst.size == 0
                or not dst.flags.c_contiguous or not src.flags.c_contiguous):
            room_left()
            groups[-1].append((dst, src))
            room -= dst.nbytes
            continue
        flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
        at = 0
        while at < flat_dst.size:
            take = min(flat_dst.size - at, max(1, room_left() // dst.itemsize))
            groups[-1].append((flat_dst[at:at + take], flat_src[at:at + take]))
            at += take
            room -= take * dst.itemsize
    return [group for group in groups if group]


def split_spans(spans: list[Span], parts: int) -> list[list[Span]]:
    """``spans`` in at most ``parts`` groups of about equal bytes, in order; a span that
    crosses a share's end is cut there."""
    share = max(1, -(-sum(span[2] for span in spans) // max(1, parts)))
    groups: list[list[Span]] = [[]]
    room = share
    for dst, src, size in spans:
        while size:
            if room <= 0 and len(groups) < parts:
                groups.append([])
                room = share
            take = size if len(groups) == parts else min(size, room)
            groups[-1].append((dst, src, take))
            dst, src, size, room = dst + take, src + take, size - take, room - take
    return [group for group in groups if group]


def _copy_group(group: list[Pair]) -> None:
    import numpy as np

    for dst, src in group:
        if (dst.nbytes >= _stream_copy.STREAM_MIN_BYTES and dst.dtype == src.dtype and dst.shape == src.shape
                and not dst.dtype.hasobject and dst.flags.c_contiguous and src.flags.c_contiguous
                and dst.flags.writeable):
            stream_copy(dst.ctypes.data, src.ctypes.data, dst.nbytes)
        else:
            np.copyto(dst, src)


def _copy_span_group(group: list[Span]) -> None:
    for dst, src, size in group:
        stream_copy(dst, src, size)


def copy_arrays(dsts: list[Any], srcs: list[Any]) -> None:
    """``np.copyto(dst, src)`` for each pair; large copies split across :func:`copy_threads`
    threads. Returns once every byte is copied (also when one part raised: then raises)."""
    threads = copy_threads()
    if threads == 1 or sum(dst.nbytes for dst in dsts) < PARALLEL_MIN_BYTES:
        _copy_group(list(zip(dsts, srcs)))
    else:
        parts = split_ranges(dsts, srcs, threads)
        run_each(parts, _copy_group, len(parts))


def copy_spans(spans: list[Span]) -> None:
    """Copy each span's bytes; large copies split across :func:`copy_threads` threads.
    Every range must stay valid (mapped, its owner alive) until this returns."""
    threads = copy_threads()
    if threads == 1 or sum(span[2] for span in spans) < PARALLEL_MIN_BYTES:
        _copy_span_group(spans)
    else:
        parts = split_spans(spans, threads)
        run_each(parts, _copy_span_group, len(parts))


def overlapping(spans: Iterable[tuple[int, int, K]]) -> set[K]:
    """The keys of the address spans ``(start, end, key)`` that share bytes with another
    span, in whole or in part (one sweep in address order)."""
    shared: set[K] = set()
    furthest: tuple[int, K] | None = None  # of the spans so far, the one ending last
    for start, end, key in sorted(spans, key=lambda span: (span[0], span[1])):
        if furthest is not None and start < furthest[0]:
            shared.update((key, furthest[1]))
        if furthest is None or end > furthest[0]:
            furthest = (end, key)
    return shared
