"""Reading committed shards: one reader for every caller, at the disk's speed.

:func:`open_shard` gives a :class:`ShardReader`: one committed shard opened for reading
(through :meth:`LocalStorage.open_shard`, so only a regular file inside a real step
directory), its size, its parsed header, and ranged :meth:`~ShardReader.readinto` into
caller buffers -- exact, or a :class:`CorruptCheckpointError` naming the file -- that
verifies the recorded checksums of exactly the blocks a read touches (the bytes of an
edge block outside the range are read alongside, once, and never again).

A full read (:meth:`~ShardReader.read_all`; the engine's load is :func:`read_shard_into`)
splits the file into block-aligned chunks of :data:`CHUNK_BYTES` that several threads
read, each chunk with one ``preadv`` straight into the caller's buffers (the header and
gaps into scratch), each thread checksumming its own blocks; zlib and the reads release
the GIL. Trade-off: a tensor's bytes land in the caller's tensor before the whole file
is verified (no second copy of the model); a damaged shard leaves them partly
overwritten, which an older step's load overwrites in turn. Plain (non-tensor) leaves are
applied only after every block verified.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from ._checksum import BlockSums
from ._errors import CorruptCheckpointError
from ._format import Entry, Image, header_length, parse_header
from ._tree import Merge, kind_named

if TYPE_CHECKING:
    from ._storage import LocalStorage

__all__ = ["CHUNK_BYTES", "ShardReader", "open_shard", "read_header", "read_shard_into", "read_tensors", "unflatten"]

CHUNK_BYTES = 32 << 20
"""Bytes per read of a full read (rounded down to whole checksum blocks, at least one)."""
THREADS = 8
"""Threads of a full read: enough outstanding reads to keep a fast device busy."""
_FIRST_READ = 64 << 10
_IOV_MAX = 1024


def read_header(fd: int, where: str, size: int, at: int = 0) -> Image:
    """The parsed safetensors header of the image starting at byte ``at`` of ``fd`` (a
    file of ``size`` bytes from there on); the one way a header is read from a file."""
    head = os.pread(fd, min(_FIRST_READ, size), at)
    n = header_length(head, where)
    if 8 + n > len(head) and 8 + n <= size:
        head += os.pread(fd, 8 + n - len(head), at + len(head))
    return parse_header(head, where, size)


class ShardReader:
    """One committed shard opened for reading: ``size``, ``image`` (the parsed header),
    ranged :meth:`readinto` and full :meth:`read_all`, each verifying what it reads.
    Owns the file it is given; a context manager. Thread safe for disjoint ranges."""

    def __init__(self, file: io.FileIO, record: dict[str, Any]) -> None:
        self.path = str(file.name)
        self._file = file
        try:
            self.size = int(record["size"])
            self._sums = BlockSums(record, self.path)
            self.image = self._header()
        except BaseException:
            file.close()
            raise

    def _header(self) -> Image:
        try:
            return read_header(self._file.fileno(), self.path, self.size)
        except CorruptCheckpointError:  # a damaged header block is reported as such
            first = min(self.size, self._sums.block_size)
            self.readinto(memoryview(bytearray(first)), 0)
            raise

    @property
    def body_start(self) -> int:
        """The file offset of the tensor data (entry offsets count from here)."""
        return len(self.image.header)

    def fileno(self) -> int:
        return self._file.fileno()

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
        """Verify the blocks holding the header (a reader that trusts its layout first)."""
        self.readinto(memoryview(bytearray(self.body_start)), 0)

    def read_all(self, parts: list[tuple[int, memoryview]], *, threads: int | None = None,
                 done: Callable[[int], None] | None = None) -> None:
        """Read the whole file on ``threads`` threads, part ``i`` (``(file offset, flat
        byte view)``, sorted, disjoint) into its view and the rest into scratch, verifying
        every block. ``done(i)`` runs (on a reading thread) once part ``i`` is read and its
        blocks verified."""
        bs = self._sums.block_size
        chunk = max(1, CHUNK_BYTES // bs) * bs
        plans = _plan_chunks(parts, self.size, chunk)
        left = [0] * len(parts)
        for plan in plans:
            for i in plan[2]:
                left[i] += 1
        guard, failed = threading.Lock(), threading.Event()

        def run(plan: tuple[int, list[memoryview | int], list[int]]) -> None:
            if failed.is_set():
                return
            start, layout, touched = plan
            pieces = [memoryview(bytearray(p)) if isinstance(p, int) else p for p in layout]
            try:
                self._preadv(pieces, start)
                self._sums.check_pieces(start, pieces)
            except BaseException:
                failed.set()
                raise
            for i in touched:
                with guard:
                    left[i] -= 1
                    finished = left[i] == 0
                if finished and done is not None:
                    done(i)

        workers = max(1, min(threads or THREADS, len(plans)))
        if workers == 1:
            for plan in plans:
                run(plan)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="flashckpt-read") as pool:
                for future in [pool.submit(run, plan) for plan in plans]:
                    future.result()
        if len(self._sums.verified) != len(self._sums.crcs):
            raise CorruptCheckpointError(f"{self.path}: {self.size} bytes read, the commit records "
                                         f"{len(self._sums.crcs)} checksum blocks")

    def verify(self, *, threads: int | None = None) -> None:
        """Read and verify every block of the file."""
        self.read_all([], threads=threads)

    def _preadv(self, pieces: list[memoryview], offset: int) -> None:
        fd, pending = self._file.fileno(), [p for p in pieces if len(p)]
        while pending:
            n = os.preadv(fd, pending[:_IOV_MAX], offset)
            if n <= 0:
                raise CorruptCheckpointError(f"{self.path}: truncated at byte {offset} (the commit recorded "
                                             f"{self.size} bytes)")
            offset += n
            while n and n >= len(pending[0]):
                n -= len(pending.pop(0))
            if n:
                pending[0] = pending[0][n:]


def _flat(view: Any) -> memoryview:
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _plan_chunks(parts: list[tuple[int, memoryview]], size: int,
                 chunk: int) -> list[tuple[int, list[memoryview | int], list[int]]]:
    """Per chunk of the file: its start, what its bytes go into in order (a slice of a
    part's view, or the length of a gap to read into scratch), the parts it touches."""
    plans = []
    i = 0
    for start in range(0, size, chunk):
        end = min(start + chunk, size)
        layout: list[memoryview | int] = []
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
            layout.append(view[pos - at:stop - at])
            touched.append(i)
            pos = stop
            if stop < at + len(view):
                break
            i += 1
        if pos < end:
            layout.append(end - pos)
        plans.append((start, layout, touched))
    return plans


def open_shard(storage: LocalStorage, step: int, rank: int) -> ShardReader:
    """Shard ``rank`` of committed ``step`` opened for reading (header parsed, not yet verified)."""
    return ShardReader(*storage.open_shard(step, rank))


def read_shard_into(storage: LocalStorage, step: int, rank: int, merge: Callable[[Image], Merge], *,
                    threads: int | None = None) -> None:
    """Read shard ``rank`` of committed ``step`` into the tensors ``merge`` picks for the
    shard's entries, on ``threads`` threads (default :data:`THREADS`), straight into the
    tensors whose host bytes are at hand (else through a scratch buffer per tensor, copied
    once its blocks verified); plain leaves are applied only once every block verified."""
    with open_shard(storage, step, rank) as reader:
        image = reader.image
        fills = merge(image)
        targets: dict[str, list[Any]] = {}
        for name, obj in fills.fills:
            targets.setdefault(name, []).append(obj)
        kinds = image.meta["kinds"]
        parts: list[tuple[int, memoryview]] = []
        finish: list[Callable[[], None] | None] = []
        for entry in image.entries:  # sorted by offset
            objs = targets.get(entry.name)
            if not objs or not entry.nbytes:
                continue
            kind = kind_named(kinds[entry.name])
            view = kind.host_bytes(objs[0])
            parts.append((reader.body_start + entry.offset, _flat(view) if view is not None
                          else memoryview(bytearray(entry.nbytes))))
            finish.append(None if view is not None and len(objs) == 1
                          else _finisher(kind, objs, entry, None if view is not None else parts[-1][1]))
        reader.read_all(parts, threads=threads, done=lambda i: finish[i]() if finish[i] is not None else None)
    fills.apply_plain()


def _finisher(kind: Any, objs: list[Any], entry: Entry, scratch: memoryview | None) -> Callable[[], None]:
    """What completes a tensor once its bytes verified: the copy out of its scratch
    buffer (a target without host bytes: an accelerator, a strided view), then to its ties."""
    target, *ties = objs

    def run() -> None:
        if scratch is not None:
            whole = Entry(entry.name, entry.dtype, entry.shape, 0, entry.nbytes)
            kind.copy([target], kind.views(scratch.obj, 0, [whole]))
        kind.copy(ties, [target] * len(ties))

    return run


def read_tensors(reader: ShardReader, *, threads: int | None = None) -> dict[str, Any]:
    """Every tensor of the shard as a new host tensor of its kind, by entry name, read by
    :meth:`ShardReader.read_all` (every block verified)."""
    kinds = reader.image.meta["kinds"]
    out: dict[str, Any] = {}
    parts: list[tuple[int, memoryview]] = []
    for entry in reader.image.entries:
        kind = kind_named(kinds[entry.name])
        out[entry.name] = obj = kind.empty(entry.dtype, entry.shape)
        if entry.nbytes:
            parts.append((reader.body_start + entry.offset, _flat(kind.host_bytes(obj))))
    reader.read_all(parts, threads=threads)
    return out


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
