"""Reading committed shards: one reader for every caller, at the disk's speed.

:func:`open_shard` gives a :class:`ShardReader`: one committed shard opened for reading
(through :meth:`LocalStorage.open_shard`, so only a regular file inside a real step
directory), its size, its parsed header (held to safetensors' own rules, see
:mod:`~flashckpt.restore._shard_file`), and ranged :meth:`~ShardReader.readinto` into
caller buffers -- exact, or a :class:`CorruptCheckpointError` naming the file -- that
verifies the recorded checksums of exactly the blocks a read touches (the bytes of an
edge block outside the range are read alongside, once, and never again).

A full read (:meth:`~ShardReader.read_all`; the engine's load is :func:`read_shard_into`)
splits the file into block-aligned chunks of :data:`CHUNK_BYTES` that several threads
read (:func:`read_streams`: one on a rotational disk), each chunk with one ``preadv`` straight into the caller's buffers (the header and
gaps into scratch), each thread checksumming its own blocks; the checksums and the reads
release the GIL. A chunk of a local file that was not in the page cache (a restart's
load: the saver wrote the file with ``O_DIRECT``) is dropped from the cache once read
(``POSIX_FADV_DONTNEED``): the load leaves no copy of the checkpoint in memory that
training needs (an exporter's :meth:`~ShardReader.map_verified` keeps it: it reads the
pages again through a map). Reads go through the cache rather than around it (``O_DIRECT``): the
kernel's readahead fills the caller's buffers with no bounce buffer, which measured
faster cold on this project's disk, with no more system time (a new process's load of
357 MB: 0.19-0.24 s against 0.24-0.37 s, of 1.49 GB: 0.74-0.77 s against 0.70-1.28 s;
a resharded FSDP load 4 -> 2: 0.31-0.39 s against 0.39-0.44 s). Trade-off: a tensor's
bytes land in the caller's tensor before the whole file is verified (no second copy of
the model); a damaged shard leaves them partly overwritten, which an older step's load
overwrites in turn. Plain (non-tensor) leaves are applied only after every block verified.
"""

from __future__ import annotations

import io
import mmap
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

from ..storage._checksum import BlockSums
from .._errors import CorruptCheckpointError
from ..memory._format import Entry, Image
from .._options import env_count
from ..memory._tree import Merge, kind_named
from ..memory._workers import run_each
from ._shard_file import (READ_THREADS_ENV, THREADS, mostly_cached, pieces_reader, read_image_header, read_streams,
                          resident_pages as _resident_pages)

if TYPE_CHECKING:
    from ..storage._local import LocalStorage

__all__ = ["CHUNK_BYTES", "Chunk", "MemoryImage", "Scratch", "ShardReader", "open_shard", "read_shard_into", "run_chunks",
           "unflatten"]

CHUNK_BYTES = 32 << 20
"""Bytes per read of a full read (rounded down to whole checksum blocks, at least one)."""
CACHING_THREADS = 2
"""Fewest threads of a full read that leaves the file cached (:meth:`ShardReader.map_verified`)."""


class ShardReader:
    """One committed shard opened for reading: ``size``, ``image`` (the parsed header),
    ranged :meth:`readinto` and full :meth:`read_all`, each verifying what it reads.
    Owns the file it is given: a local file (``io.FileIO``), or any object with ``name``,
    ``close()`` and positional ``preadv(pieces, offset)`` (an object store's shard, a
    :class:`MemoryImage`). ``record`` is the commit's record of the shard (its size and
    block checksums); a :class:`MemoryImage` has none and nothing is verified.
    A context manager; thread safe for disjoint ranges."""

    def __init__(self, file: Any, record: dict[str, Any] | None) -> None:
        self.path = str(file.name)
        self._file = file
        self._cached: bytes | None = None
        """Per page, nonzero where it was in the page cache before the first chunk was read."""
        self._cached_known = False
        self._cached_guard = threading.Lock()
        self._keep_cached = False
        """Whether a full read leaves what it read in the cache (:meth:`map_verified`)."""
        try:
            self.size = int(record["size"]) if record is not None else file.size
            self.streams = (read_streams(os.fstat(file.fileno()).st_dev) if isinstance(file, io.FileIO)
                            else env_count(READ_THREADS_ENV, THREADS))
            """Reads of this shard that suit its storage at once (:func:`read_streams`)."""
            self._read_pieces = pieces_reader(file, self.path, self.size)
            self._sums = BlockSums(record, self.path) if record is not None else _UNRECORDED
            self.image = self._header()
        except BaseException:
            file.close()
            raise

    def _header(self) -> Image:
        try:
            return read_image_header(self._read_pieces, self.path, self.size)
        except CorruptCheckpointError:  # a damaged header block is reported as such
            first = min(self.size, self._sums.block_size)
            self.readinto(memoryview(bytearray(first)), 0)
            raise

    @property
    def body_start(self) -> int:
        """The file offset of the tensor data (entry offsets count from here)."""
        return len(self.image.header)

    def fileno(self) -> int:
        """The local file's descriptor (an object store's shard has none: ``OSError``)."""
        if not isinstance(self._file, io.FileIO):
            raise io.UnsupportedOperation(f"{self.path} is not a local file")
        return self._file.fileno()

    def advise(self, offset: int, length: int) -> None:
        """Let a local file's reads of ``[offset, offset + length)`` start now (``WILLNEED``)."""
        if isinstance(self._file, io.FileIO):
            os.posix_fadvise(self._file.fileno(), offset, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def readinto(self, view: Any, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset``, verifying every block the
        range touches that no earlier read verified."""
        view = _flat(view)
        end = offset + len(view)
        if offset < 0 or end > self.size:
            raise CorruptCheckpointError(f"{self.path}: bytes {offset}-{end} lie outside its {self.size} bytes")
        if not view:
            return
        bs, sums = self._sums.block_size, self._sums
        first, last = offset // bs, (end - 1) // bs
        lo = offset if first in sums.verified else first * bs
        hi = end if last in sums.verified else min((last + 1) * bs, self.size)
        pieces = [memoryview(bytearray(offset - lo))] if lo < offset else []
        pieces.append(view)
        if hi > end:
            pieces.append(memoryview(bytearray(hi - end)))
        self._preadv(pieces, lo)
        sums.check_pieces(lo, pieces)

    def verify_header(self) -> None:
        """Verify the blocks holding the header, unless a read verified them already."""
        if all(b in self._sums.verified for b in range(-(-self.body_start // self._sums.block_size))):
            return
        self.readinto(memoryview(bytearray(self.body_start)), 0)

    def read_all(self, parts: list[Part], *, threads: int | None = None,
                 done: Callable[[int], None] | None = None) -> None:
        """Read the whole file on ``threads`` threads, part ``i`` (``(file offset, flat
        byte view or Scratch)``, sorted, disjoint) into its view and the rest into scratch,
        verifying every block. ``done(i)`` runs (on a reading thread) once part ``i`` is
        read and its blocks verified."""
        run_chunks(self.plan(parts, whole=True), threads=threads,
                   done=None if done is None else lambda _, i: done(i))
        if len(self._sums.verified) != len(self._sums.crcs):
            raise CorruptCheckpointError(f"{self.path}: {self.size} bytes read, the commit records "
                                         f"{len(self._sums.crcs)} checksum blocks")

    def plan(self, parts: list[Part], *, whole: bool = False) -> list["Chunk"]:
        """The reads that fill ``parts`` (``(file offset, flat byte view or Scratch)``,
        sorted, disjoint): the whole file (``whole``), else only the checksum blocks the
        parts touch, runs of adjacent touched blocks read together; each read at most
        :data:`CHUNK_BYTES` and block aligned, so each verifies its own blocks. Run them
        with :func:`run_chunks` (one pool for the chunks of many readers)."""
        bs = self._sums.block_size
        chunk = max(1, CHUNK_BYTES // bs) * bs
        if whole:
            spans = [(0, self.size)] if self.size else []
        else:
            spans = []
            for at, view in parts:
                if not len(view):
                    continue
                if at < 0 or at + len(view) > self.size:
                    raise CorruptCheckpointError(f"{self.path}: bytes {at}-{at + len(view)} lie outside its "
                                                 f"{self.size} bytes")
                lo, hi = at // bs * bs, min(-(-(at + len(view)) // bs) * bs, self.size)
                if spans and lo <= spans[-1][1]:
                    spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
                else:
                    spans.append((lo, hi))
        out: list[Chunk] = []
        first = 0
        for lo, hi in spans:
            while first < len(parts) and parts[first][0] + len(parts[first][1]) <= lo:
                first += 1
            for start, layout, touched in _plan_chunks(parts[first:], hi, chunk, lo):
                out.append(Chunk(self, start, layout, [first + i for i in touched]))
        return out

    def verify(self, *, threads: int | None = None) -> None:
        """Read and verify every block of the file."""
        self.read_all([], threads=threads)

    def map_verified(self, *, threads: int | None = None) -> mmap.mmap:
        """The whole local file mapped read-only, after a full read (:meth:`verify`) that
        leaves what it read in the page cache: the caller's reads of the map then come
        from memory, not from the disk a second time. A disk error is raised by the read
        (as :class:`OSError`) rather than met through the map (``SIGBUS``) while the pages
        stay cached (a shard larger than free memory is partly read from disk again).
        The read runs on at least :data:`CACHING_THREADS` threads: filling the page cache
        costs the kernel about as much CPU time as the disk takes (1.49 GB, rotational:
        1.5-2.0 s on one thread against 1.1-1.4 s on two or eight, where a read that drops
        its pages takes 1.1-1.3 s on any). Close the map when done."""
        self._keep_cached = True
        try:
            self.verify(threads=threads or max(self.streams, CACHING_THREADS))
        finally:
            self._keep_cached = False
        length = os.fstat(self.fileno()).st_size
        if length != self.size:  # a map past the end of the file faults (SIGBUS) when read
            raise CorruptCheckpointError(f"{self.path}: {length} bytes, the commit recorded {self.size} (truncated?)")
        return mmap.mmap(self.fileno(), self.size, prot=mmap.PROT_READ)

    def verified_whole(self) -> mmap.mmap | bytearray:
        """The whole shard, every block verified: mapped (:meth:`map_verified`) when it is a
        local file, else read into memory (an object in a bucket has no file to map)."""
        if isinstance(self._file, io.FileIO):
            return self.map_verified()
        buf = bytearray(self.size)
        self.read_all([(0, memoryview(buf))])
        return buf

    def _preadv(self, pieces: list[memoryview], offset: int) -> None:
        self._read_pieces([p for p in pieces if len(p)], offset)

    def _read_chunk(self, start: int, pieces: list[Any], gaps: threading.local) -> None:
        """Fill ``pieces`` (views, or gap lengths to skip) with the bytes from block-aligned
        ``start`` and verify their blocks; a range that was not cached is not left cached
        (unless :meth:`map_verified` reads it)."""
        cached = self._cached_before()  # before this chunk's read fills the cache
        views, scratch = [], _gap_buffer(gaps, sum(p for p in pieces if isinstance(p, int)))
        for p in pieces:
            if isinstance(p, int):
                views.append(scratch[:p])
                scratch = scratch[p:]
            else:
                views.append(p)
        self._preadv(views, start)
        self._sums.check_pieces(start, views)
        length = sum(len(v) for v in views)
        if cached is not None and not self._keep_cached and not mostly_cached(cached, start, length):
            os.posix_fadvise(self._file.fileno(), start, length, os.POSIX_FADV_DONTNEED)

    def _cached_before(self) -> bytes | None:
        """Which pages of this local file were cached before its first chunk was read
        (None: not a local file, or the kernel would not say)."""
        with self._cached_guard:
            if not self._cached_known:
                self._cached_known = True
                if isinstance(self._file, io.FileIO):
                    self._cached = _resident_pages(self._file.fileno(), self.size)
        return self._cached


class MemoryImage:
    """A shard image in this host's memory (a shared-memory slot's), read like a file
    by a :class:`ShardReader`: positional copies that release the GIL, so that a ranged
    read's threads copy at once. ``close`` runs when the reader closes."""

    def __init__(self, buffer: Any, name: str, close: Callable[[], None]) -> None:
        import numpy as np  # in the methods, not at import: the saver process starts without numpy

        self.name, self._close = name, close
        self._bytes = np.frombuffer(buffer, np.uint8)
        self.size = len(self._bytes)

    def preadv(self, pieces: list[memoryview], offset: int) -> None:
        import numpy as np

        for piece in pieces:
            if offset + len(piece) > self.size:
                raise CorruptCheckpointError(f"{self.name}: bytes {offset}-{offset + len(piece)} lie outside "
                                             f"its {self.size} bytes")
            np.copyto(np.frombuffer(piece, np.uint8), self._bytes[offset:offset + len(piece)])
            offset += len(piece)

    def close(self) -> None:
        import numpy as np

        self._bytes = np.empty(0, np.uint8)  # no export of the buffer outlives the reader
        self._close()


class _EveryBlock:
    def __contains__(self, block: object) -> bool:
        return True

    def __len__(self) -> int:
        return 0


class _Unrecorded:
    """The block checksums of a :class:`MemoryImage`: none. A slot is written by this
    job's own processes and trusted as the engine's load from memory trusts it; every
    block counts as verified, so reads never widen to whole blocks."""

    block_size = mmap.PAGESIZE
    crcs: list[int] = []
    verified = _EveryBlock()

    def check_pieces(self, start: int, pieces: list[memoryview]) -> None:
        return None


_UNRECORDED = _Unrecorded()


def _gap_buffer(gaps: threading.local, nbytes: int) -> memoryview:
    """A buffer of at least ``nbytes`` for bytes read only to be checksummed: this thread's
    in ``gaps`` (one read's), reused across its chunks, since a fresh one per chunk costs a
    page fault per page."""
    buf = getattr(gaps, "buf", None)
    if buf is None or len(buf) < nbytes:
        gaps.buf = buf = memoryview(bytearray(nbytes))
    return buf


def _flat(view: Any) -> memoryview:
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Scratch:
    """A part's buffer that is made when the first chunk reading into it starts and dropped
    (:meth:`take`) once the part is done: at most the parts being read exist at once."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buf: memoryview | None = None
        self._guard = threading.Lock()

    def __len__(self) -> int:
        return self.nbytes

    def view(self) -> memoryview:
        with self._guard:
            if self._buf is None:
                self._buf = memoryview(bytearray(self.nbytes))
            return self._buf

    def take(self) -> memoryview:
        """The filled buffer, dropped from here."""
        with self._guard:
            buf, self._buf = self._buf, None
        return buf if buf is not None else memoryview(bytearray(self.nbytes))


Part = tuple[int, "memoryview | Scratch"]
"""(file offset, flat byte view or :class:`Scratch`) of a full read."""


def _plan_chunks(parts: list[Part], size: int, chunk: int, begin: int = 0) -> list[tuple[int, list[Any], list[int]]]:
    """Per chunk of the file's bytes ``[begin, size)``: its start, what its bytes go into in order (a slice of a
    part's view, ``(scratch, lo, hi)``, or the length of a gap to read into scratch),
    the parts it touches."""
    plans = []
    i = 0
    for start in range(begin, size, chunk):
        end = min(start + chunk, size)
        layout: list[Any] = []
        touched: list[int] = []
        pos = start
        while i < len(parts) and parts[i][0] < end:
            at, view = parts[i]
            if at + len(view) <= pos:
                i += 1
                continue
            if at > pos:
                layout.append(at - pos)
                pos = at
            stop = min(at + len(view), end)
            layout.append((view, pos - at, stop - at) if isinstance(view, Scratch) else view[pos - at:stop - at])
            touched.append(i)
            pos = stop
            if stop < at + len(view):
                break
            i += 1
        if pos < end:
            layout.append(end - pos)
        plans.append((start, layout, touched))
    return plans


class Chunk:
    """One read of a planned ranged or full read (:meth:`ShardReader.plan`): ``reader``'s
    bytes from ``start`` into ``layout`` (slices of parts' views, ``(scratch, lo, hi)``,
    or gap lengths read into scratch), touching parts ``touched``."""

    __slots__ = ("reader", "start", "layout", "touched")

    def __init__(self, reader: ShardReader, start: int, layout: list[Any], touched: list[int]) -> None:
        self.reader, self.start, self.layout, self.touched = reader, start, layout, touched

    def read(self, gaps: threading.local) -> None:
        """Read and verify (every whole block not yet verified: a chunk is block aligned);
        ``gaps`` keeps each thread's buffer for the bytes read only to be verified."""
        self.reader._read_chunk(self.start, [p[0].view()[p[1]:p[2]] if isinstance(p, tuple) else p
                                             for p in self.layout], gaps)


def run_chunks(chunks: list[Chunk], *, threads: int | None = None,
               done: Callable[[ShardReader, int], None] | None = None) -> None:
    """Read ``chunks`` (of one or many readers) on ``threads`` threads (default: the
    most :attr:`ShardReader.streams` of their readers). ``done(reader, i)`` runs on a reading thread once every chunk
    touching part ``i`` of that reader's plan is read and verified. The first error
    (a :class:`CorruptCheckpointError` naming the file and bytes) stops the reads not yet
    started and is raised once the others end."""
    left: dict[tuple[int, int], int] = {}
    for c in chunks:
        for i in c.touched:
            left[id(c.reader), i] = left.get((id(c.reader), i), 0) + 1
    guard, failed, gaps = threading.Lock(), threading.Event(), threading.local()

    def run(c: Chunk) -> None:
        if failed.is_set():
            return
        try:
            c.read(gaps)
        except BaseException:
            failed.set()
            raise
        for i in c.touched:
            with guard:
                left[id(c.reader), i] -= 1
                finished = left[id(c.reader), i] == 0
            if finished and done is not None:
                done(c.reader, i)

    run_each(chunks, run, threads or max((c.reader.streams for c in chunks), default=1))


def open_shard(storage: LocalStorage, step: int, rank: int, *, whole: bool = False) -> ShardReader:
    """Shard ``rank`` of committed ``step`` opened for reading (header parsed, not yet
    verified). ``whole``: every byte will be read, which a shard that can fetch ahead
    (an object's ``read_whole``) is told before the header's read."""
    file, record = storage.open_shard(step, rank)
    if whole and hasattr(file, "read_whole"):
        file.read_whole()
    return ShardReader(file, record)


def read_shard_into(storage: LocalStorage, step: int, rank: int, merge: Callable[[Image], Merge], *,
                    threads: int | None = None) -> None:
    """Read shard ``rank`` of committed ``step`` into the tensors ``merge`` picks for the
    shard's entries, on ``threads`` threads (default: :func:`read_streams`), straight into the
    tensors whose host bytes are at hand (else through a scratch buffer per tensor, copied
    once its blocks verified); plain leaves are applied only once every block verified."""
    with open_shard(storage, step, rank, whole=True) as reader:
        image = reader.image
        fills = merge(image)
        targets: dict[str, list[Any]] = {}
        for name, obj in fills.fills:
            targets.setdefault(name, []).append(obj)
        kinds = image.meta["kinds"]
        parts: list[Part] = []
        finish: list[Callable[[], None] | None] = []
        for entry in image.entries:  # sorted by offset
            objs = targets.get(entry.name)
            if not objs or not entry.nbytes:
                continue
            kind = kind_named(kinds[entry.name])
            view = kind.host_bytes(objs[0])
            scratch = Scratch(entry.nbytes) if view is None else None
            parts.append((reader.body_start + entry.offset, scratch or _flat(view)))
            finish.append(None if view is not None and len(objs) == 1 else _finisher(kind, objs, entry, scratch))
        reader.read_all(parts, threads=threads, done=lambda i: finish[i]() if finish[i] is not None else None)
    fills.apply_plain()


def _finisher(kind: Any, objs: list[Any], entry: Entry, scratch: Scratch | None) -> Callable[[], None]:
    """What completes a tensor once its bytes verified: the copy out of its scratch
    buffer (a target without host bytes: an accelerator, a strided view), then to its ties."""
    target, *ties = objs

    def run() -> None:
        if scratch is not None:
            whole = Entry(entry.name, entry.dtype, entry.shape, 0, entry.nbytes)
            kind.copy([target], kind.views(scratch.take().obj, 0, [whole]))
        kind.copy(ties, [target] * len(ties))

    return run


def unflatten(node: Any, leaf: Callable[[str], Any], pickled: Callable[[str], Any]) -> Any:
    """A saved tree skeleton (``meta["tree"]``) as Python values: tensor entries are
    ``leaf(name)``, pickled ones ``pickled(base64 text)``; dict keys are interned as the
    literals they were (so pickle memoizes them alike)."""
    if "v" in node:
        return node["v"]
    if "t" in node:
        return leaf(node["t"])
    if "p" in node:
        return pickled(node["p"])
    if "d" in node:
        return {sys.intern(k) if type(k) is str else k: unflatten(v, leaf, pickled) for k, v in node["d"]}
    items = [unflatten(v, leaf, pickled) for v in node.get("l", node.get("u"))]
    return tuple(items) if "u" in node else items
