"""Reading a sharded checkpoint into another sharding: geometry and ranged reads.

A sharded adapter (FSDP, ZeRO, Megatron) saves, next to each rank's local tensors, a
plain JSON *layout* under :data:`LAYOUT_KEY`: for every tensor its global shape and
the piece this rank holds (``offsets`` and ``lengths`` per dimension). To load with
another world size or mesh, every rank parses the headers of all committed shards
(only the first bytes of each file), intersects the pieces there with the piece it
needs now, and reads just those byte ranges: ``preadv`` straight into the target when
both sides of a range are contiguous (the usual dim-0 sharding), else the span from
the box's first byte to its last, from which the box is copied. No other rank's file
is ever read whole into memory.

Pieces of one tensor are either identical (replicated) or disjoint; identical pieces
are read once, preferring the caller's own rank. Every range is read through the
shard's :class:`~flashckpt.restore._shard_read.ShardReader`, which verifies the checksums of the
file blocks it touches: a resharded load reads a little around its ranges, never every
byte of every shard.

Framework neutral: targets are numpy ``uint8`` arrays whose last dimension is in
bytes (an adapter views its host tensors that way), so any dtype works, bfloat16
included.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from .._errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ..memory._format import DTYPE_SIZES, Entry, Image
from ._shard_file import file_header
from ._shard_read import Scratch, ShardReader, open_shard, run_chunks

if TYPE_CHECKING:
    from ..storage._protocol import Storage

__all__ = ["LAYOUT_KEY", "Fill", "Piece", "Source", "RangeReader", "chunk_pieces", "path_key", "tensor_names",
           "plain_value", "skeleton_child", "read_sources", "source_of", "close_sources", "byte_shape"]

_OBJECT_OPENS = 16
"""Shards of an object store opened at once by :func:`read_sources` (a round trip each)."""

LAYOUT_KEY = "__flashckpt_layout__"
"""Reserved top-level key of a sharded state: the rank's layout as a JSON string."""


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of a tensor in global coordinates (one rank's shard)."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def intersect(self, other: "Piece") -> "Piece | None":
        """The common box, or None when it is empty."""
        offsets, lengths = [], []
        for a, la, b, lb in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            lo, hi = max(a, b), min(a + la, b + lb)
            if hi <= lo:
                return None
            offsets.append(lo)
            lengths.append(hi - lo)
        return Piece(tuple(offsets), tuple(lengths))

    def to_json(self) -> dict[str, list[int]]:
        return {"offsets": list(self.offsets), "lengths": list(self.lengths)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Piece":
        return cls(tuple(obj["offsets"]), tuple(obj["lengths"]))


def full_piece(shape: Iterable[int]) -> Piece:
    shape = tuple(shape)
    return Piece((0,) * len(shape), shape)


def chunk_pieces(shape: tuple[int, ...], world: int, dim: int = 0) -> list[Piece]:
    """Each rank's piece under ``torch.chunk`` on ``dim`` (FSDP's rule): ranks get
    ``ceil(n / world)`` rows in order, the last ones fewer or none."""
    n = shape[dim]
    size = -(-n // world) if n else 0
    pieces = []
    for r in range(world):
        lo = min(r * size, n)
        hi = min(lo + size, n)
        offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
        lengths = tuple(hi - lo if d == dim else s for d, s in enumerate(shape))
        pieces.append(Piece(offsets, lengths))
    return pieces


def byte_shape(lengths: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The shape of a tensor viewed as bytes: the last dimension times the item size."""
    if not lengths:
        return (itemsize,)
    return tuple(lengths[:-1]) + (lengths[-1] * itemsize,)


def _byte_piece(piece: Piece, itemsize: int) -> Piece:
    if not piece.lengths:
        return Piece((0,), (itemsize,))
    return Piece(piece.offsets[:-1] + (piece.offsets[-1] * itemsize,), byte_shape(piece.lengths, itemsize))


def _flat_offset(shape: tuple[int, ...], index: tuple[int, ...]) -> int:
    """The position of element ``index`` in a C-contiguous array of ``shape``."""
    offset, stride = 0, 1
    for d in reversed(range(len(shape))):
        offset += index[d] * stride
        stride *= shape[d]
    return offset


def _contiguous_range(shape: tuple[int, ...], start: tuple[int, ...], length: tuple[int, ...]) -> tuple[int, int] | None:
    """(byte offset, byte count) of a box of a C-contiguous array if the box is one run."""
    partial = [d for d in range(len(shape)) if length[d] != shape[d]]
    if partial and any(length[d] != 1 for d in range(partial[-1])):
        return None
    stride, offset = 1, 0
    for d in reversed(range(len(shape))):
        offset += start[d] * stride
        stride *= shape[d]
    count = 1
    for x in length:
        count *= x
    return offset, count


# -- tree skeletons (see flashckpt.memory._tree) ---------------------------------------------

def _escape(part: Any) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def path_key(parts: Iterable[Any]) -> str:
    """The key of a tree position in layouts: escaped parts joined by "/"."""
    return "/".join(_escape(p) for p in parts)


def tensor_names(skeleton: Any) -> dict[str, str]:
    """Every tensor position of a saved tree (its :func:`path_key`) -> its entry name."""
    out: dict[str, str] = {}

    def walk(node: Any, parts: tuple) -> None:
        if "t" in node:
            out[path_key(parts)] = node["t"]
        elif "d" in node:
            for k, child in node["d"]:
                walk(child, parts + (k,))
        else:
            for i, child in enumerate(node.get("l", node.get("u", ()))):
                walk(child, parts + (i,))

    walk(skeleton, ())
    return out


def plain_value(skeleton: Any, key: str) -> Any:
    """A top-level plain leaf of a saved tree, or None if absent."""
    return skeleton_child(skeleton, key).get("v")


def skeleton_child(skeleton: Any, *keys: str) -> dict[str, Any]:
    """The node of a saved tree at dict keys ``keys`` ({} where there is none)."""
    node = skeleton
    for key in keys:
        node = next((child for k, child in node.get("d", ()) if k == key), {})
    return node


# -- sources --------------------------------------------------------------------------

@dataclass(slots=True)
class Source:
    """One committed shard: its reader (parsed header, its blocks verified, or verified by
    the :class:`RangeReader` that reads from it) and layout."""

    rank: int
    reader: ShardReader
    layout: dict[str, Any]
    names: dict[str, str]
    entries: dict[str, Entry] = field(default_factory=dict)
    blocks: dict[str, list[tuple[Piece, str]]] | None = None
    """Instead of the layout's one piece per tensor: any number of saved blocks per
    tensor key, ``(piece, entry name)`` each (megatron keeps a layer stack's blocks under
    one key); a key this shard does not hold has none."""

    @property
    def path(self) -> str:
        return self.reader.path

    @property
    def image(self) -> Image:
        return self.reader.image

    def piece(self, key: str) -> Piece | None:
        """The layout's piece of tensor ``key`` (a one-piece-per-tensor layout), or None."""
        rec = self.layout["tensors"].get(key)
        return Piece.from_json(rec) if rec is not None else None

    def entry(self, key: str) -> Entry:
        """The entry of tensor ``key`` in a one-piece-per-tensor layout."""
        return self.entries[self.names[key]]

    def pieces(self, key: str) -> list[tuple[Piece, str]] | None:
        """``(piece, entry name)`` of every block of tensor ``key`` in this shard; None
        when its layout does not name ``key``."""
        if self.blocks is not None:
            return self.blocks.get(key, [])
        piece = self.piece(key)
        return None if piece is None else [(piece, self.names[key])]

    def file_offset(self, entry: Entry) -> int:
        return self.reader.body_start + entry.offset


def read_layout(image: Image, where: str) -> dict[str, Any]:
    raw = plain_value(image.meta.get("tree", {}), LAYOUT_KEY)
    if not isinstance(raw, str):
        raise CheckpointError(f"{where} holds no sharded layout ({LAYOUT_KEY}); it was not saved by a "
                              "sharded checkpointer and cannot be resharded")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: unreadable layout: {exc}") from exc


def read_header(f: Any, expected_size: int) -> tuple[Image, int]:
    """(parsed header, size) of a shard opened by the storage's ``open_shard``, read with
    positional reads. Prefer :func:`open_shard`'s reader, which also verifies."""
    size = f.size if hasattr(f, "size") else os.fstat(f.fileno()).st_size
    if size != expected_size:
        raise CorruptCheckpointError(f"{f.name}: {size} bytes, the commit recorded {expected_size} (truncated?)")
    return file_header(f, size), size


def read_sources(storage: Storage, step: int, *, verify_headers: bool = True, layout: bool = True) -> list[Source]:
    """Readers and layouts of every rank's shard of a committed step (by rank), each
    shard opened once with :func:`open_shard` and its header blocks verified (give them
    to a :class:`RangeReader`, which closes them, or call :func:`close_sources`).
    ``verify_headers=False`` leaves the header blocks to the :class:`RangeReader`, which
    verifies those of every shard it reads from along with its reads (the layouts only
    choose which shards to read; a caller that uses a shard's header otherwise verifies
    it with ``reader.verify_header()``). ``layout=False``: shards without a sharded
    layout (the caller places their blocks itself, as megatron's reader does). On a
    local disk one after another (threads were no faster); on an object store, where each
    opening is a round trip, at once on threads. The first error is raised once every
    opened shard is closed."""
    world = int(storage.metadata(step)["world_size"])

    def one(rank: int) -> Source:
        return source_of(rank, open_shard(storage, step, rank), layout=layout, verify=verify_headers)

    if not storage.remote or world <= 1:
        sources: list[Source] = []
        try:
            for rank in range(world):
                sources.append(one(rank))
        except BaseException:
            close_sources(sources)
            raise
        return sources
    with ThreadPoolExecutor(min(world, _OBJECT_OPENS), thread_name_prefix="flashckpt-open") as pool:
        futures = [pool.submit(one, rank) for rank in range(world)]
        done = [f.exception() or f.result() for f in futures]
    errors = [d for d in done if isinstance(d, BaseException)]
    if errors:
        close_sources([d for d in done if isinstance(d, Source)])
        raise errors[0]
    return done


def source_of(rank: int, reader: ShardReader, *, layout: bool, verify: bool = True) -> Source:
    """A :class:`Source` of an open shard, its header blocks verified unless ``verify`` is
    False (closed on error); ``layout=False``: an unsharded checkpoint, every tensor read whole."""
    try:
        if verify:
            reader.verify_header()
        image = reader.image
        return Source(rank, reader, read_layout(image, reader.path) if layout else {"tensors": {}},
                      tensor_names(image.meta["tree"]), {e.name: e for e in image.entries})
    except BaseException:
        reader.close()
        raise


def close_sources(sources: list[Source]) -> None:
    for src in sources:
        src.reader.close()


# -- ranged reads ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Fill:
    """One target of :meth:`RangeReader.fill_many`: ``dst`` (C-contiguous uint8, shape
    :func:`byte_shape` of ``want``) gets the box ``want`` of tensor ``key`` (``dtype``,
    ``global_shape``), identical pieces read from rank ``prefer`` first; or, with
    ``source`` and ``entry`` instead, the whole entry of that shard (``dst`` of
    ``entry.nbytes`` bytes)."""

    dst: np.ndarray
    key: str | None = None
    want: Piece | None = None
    dtype: str | None = None
    global_shape: tuple[int, ...] = ()
    prefer: int = 0
    source: Source | None = None
    entry: Entry | None = None


class RangeReader:
    """Fills target pieces from the byte ranges of source shards that overlap them,
    through each source's :class:`ShardReader` (exact reads, touched blocks verified, and
    the header blocks of every source read from).
    Use as a context manager; closes the sources when it closes."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources
        self.bytes_read = 0

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        close_sources(self.sources)

    def _plan(self, key: str, want: Piece, dtype: str, global_shape: tuple[int, ...], prefer: int):
        """(source, entry, source piece, box) for each distinct source piece overlapping
        ``want``, rank ``prefer`` first; raises when they do not cover ``want`` exactly."""
        order = sorted(self.sources, key=lambda s: (s.rank != prefer, s.rank))
        seen: set[Piece] = set()
        plan, covered = [], 0
        for src in order:
            blocks = src.pieces(key)
            if blocks is None:
                src.reader.verify_header()  # a damaged header is reported as such, not as a mismatch
                raise StateMismatchError(f"{src.path} has no entry {key!r} in its layout")
            for piece, name in blocks:
                if piece in seen:
                    continue
                seen.add(piece)
                box = piece.intersect(want)
                if box is None or box.numel == 0:
                    continue
                entry = src.entries[name]
                if entry.dtype != dtype:
                    src.reader.verify_header()
                    raise StateMismatchError(f"{key}: checkpoint has {entry.dtype}, state has {dtype}")
                if not _same_extent(tuple(entry.shape), piece.lengths):
                    raise CorruptCheckpointError(f"{src.path}: entry {key!r} has shape {list(entry.shape)} "
                                                 f"but its layout says {list(piece.lengths)}")
                plan.append((src, entry, piece, box))
                covered += box.numel
        if covered != want.numel:
            raise CorruptCheckpointError(
                f"{key}: the shards cover {covered} of the {want.numel} elements needed at offsets "
                f"{list(want.offsets)} (global shape {list(global_shape)}); a shard is missing or the layouts overlap")
        return plan

    def prefetch(self, key: str, want: Piece, dtype: str, global_shape: tuple[int, ...], prefer: int = 0) -> None:
        """Ask the kernel to start reading what :meth:`fill` will read (``WILLNEED``), so
        that the reads of all tensors queue up instead of waiting one by one."""
        if want.numel == 0:
            return
        itemsize = DTYPE_SIZES[dtype]
        for src, entry, piece, box in self._plan(key, want, dtype, global_shape, prefer):
            spiece, bbox = _byte_piece(piece, itemsize), _byte_piece(box, itemsize)
            s_start = tuple(b - o for b, o in zip(bbox.offsets, spiece.offsets))
            run = _contiguous_range(spiece.lengths, s_start, bbox.lengths) or (0, entry.nbytes)
            src.reader.advise(src.file_offset(entry) + run[0], run[1])

    def fill(self, key: str, dst: np.ndarray, want: Piece, dtype: str, global_shape: tuple[int, ...],
             prefer: int = 0) -> None:
        """Fill ``dst`` (C-contiguous uint8, shape :func:`byte_shape` of ``want``) with
        the box ``want`` of tensor ``key``, from every source whose piece overlaps it;
        identical pieces are read once, from rank ``prefer`` first. One range at a time;
        :meth:`fill_many` reads many targets' ranges together."""
        self._read_one(Fill(dst, key=key, want=want, dtype=dtype, global_shape=global_shape, prefer=prefer))

    def read_entry(self, src: Source, entry: Entry, dst: np.ndarray) -> None:
        """Read one whole entry of ``src`` into ``dst`` (C-contiguous, ``entry.nbytes`` bytes)."""
        self._read_one(Fill(dst, source=src, entry=entry))

    def _read_one(self, fill: Fill) -> None:
        for src, at, view, finish, nbytes in self._ops(fill):
            _read_range(src, at, view, finish)
            self.bytes_read += nbytes

    def fill_many(self, fills: list[Fill], *, threads: int | None = None) -> None:
        """Fill every target of ``fills`` at once: the byte ranges of all of them, per
        source file sorted and merged into block-aligned reads of up to
        :data:`~flashckpt.restore._shard_read.CHUNK_BYTES`, read on ``threads`` threads straight
        into the targets (a strided box through a scratch span, copied once verified),
        each read verifying the checksum blocks it holds. Bit for bit what :meth:`fill`
        and :meth:`read_entry` one by one give; a damaged block raises
        :class:`CorruptCheckpointError` naming the file and bytes (targets then hold
        partly read bytes). Targets must not overlap one another."""
        ops: dict[int, list[tuple[int, Any, Any]]] = {}  # id(source) -> (file offset, view | Scratch, finish)
        by_id = {id(src): src for src in self.sources}
        for fill in fills:
            for src, at, view, finish, nbytes in self._ops(fill):
                by_id.setdefault(id(src), src)
                ops.setdefault(id(src), []).append((at, view, finish))
                self.bytes_read += nbytes
        chunks, finishers, serial = [], {}, []
        for sid, items in ops.items():
            items.sort(key=lambda op: op[0])
            parts, finish, end = [], [], -1
            for at, view, fin in items:
                if at < end:  # overlaps the previous range (never for disjoint targets): read alone
                    serial.append((by_id[sid], at, view, fin))
                    continue
                parts.append((at, view))
                finish.append(fin)
                end = at + len(view)
            reader = by_id[sid].reader
            finishers[id(reader)] = finish
            chunks += reader.plan(parts)
        run_chunks(chunks, threads=threads,
                   done=lambda reader, i: finishers[id(reader)][i] and finishers[id(reader)][i]())
        for src, at, view, fin in serial:
            _read_range(src, at, view, fin)
        for sid in ops:  # the layout that placed these reads: its blocks are usually read already
            by_id[sid].reader.verify_header()

    def _ops(self, fill: Fill):
        """(source, file offset, flat view or Scratch, finish or None, bytes) per range of ``fill``."""
        if fill.source is not None:
            src, entry = fill.source, fill.entry
            flat = fill.dst.reshape(-1)
            if flat.nbytes != entry.nbytes:
                raise StateMismatchError(f"{src.path}: entry {entry.name!r} has {entry.nbytes} bytes, "
                                         f"the target {flat.nbytes}")
            if entry.nbytes:
                yield src, src.file_offset(entry), flat, None, entry.nbytes
            return
        want, dst = fill.want, fill.dst
        if want.numel == 0:
            return
        itemsize = DTYPE_SIZES[fill.dtype]
        dpiece = _byte_piece(want, itemsize)
        for src, entry, piece, box in self._plan(fill.key, want, fill.dtype, fill.global_shape, fill.prefer):
            spiece, box = _byte_piece(piece, itemsize), _byte_piece(box, itemsize)
            s_start = tuple(b - o for b, o in zip(box.offsets, spiece.offsets))
            d_start = tuple(b - o for b, o in zip(box.offsets, dpiece.offsets))
            s_run = _contiguous_range(spiece.lengths, s_start, box.lengths)
            d_run = _contiguous_range(dpiece.lengths, d_start, box.lengths)
            base = src.file_offset(entry)
            if s_run is not None and d_run is not None:
                yield src, base + s_run[0], dst.reshape(-1)[d_run[0]:d_run[0] + d_run[1]], None, box.numel
            else:
                first, span, copy = _strided(spiece, s_start, d_start, box, dst)
                scratch = Scratch(span)
                yield src, base + first, scratch, lambda s=scratch, c=copy: c(np.frombuffer(s.take(), np.uint8)), box.numel


def _same_extent(shape: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
    """Whether an entry of ``shape`` holds a piece of ``lengths`` in C order: the same
    shape, or one without leading axes of extent 1 (megatron's prepended axes)."""
    extra = len(lengths) - len(shape)
    return extra >= 0 and lengths[extra:] == shape and all(n == 1 for n in lengths[:extra])


def _read_range(src: Source, at: int, view: Any, finish: Any) -> None:
    """One range read on this thread (its touched blocks verified), then its ``finish``."""
    src.reader.readinto(view.view() if isinstance(view, Scratch) else view, at)
    src.reader.verify_header()
    if finish is not None:
        finish()


def _strided(spiece: Piece, s_start: tuple[int, ...], d_start: tuple[int, ...], box: Piece, dst: np.ndarray):
    """(offset in the source entry, bytes, ``copy(span)``) of a box that is not one run:
    the span from its first byte to its last, and the copy of the box out of it into ``dst``."""
    first = _flat_offset(spiece.lengths, s_start)
    last = _flat_offset(spiece.lengths, tuple(a + n - 1 for a, n in zip(s_start, box.lengths)))
    strides = tuple(_flat_offset(spiece.lengths, tuple(int(d == k) for d in range(len(spiece.lengths))))
                    for k in range(len(spiece.lengths)))
    d_idx = tuple(slice(a, a + n) for a, n in zip(d_start, box.lengths))

    def copy(span: np.ndarray) -> None:
        dst[d_idx] = np.lib.stride_tricks.as_strided(span, box.lengths, strides, writeable=False)

    return first, last + 1 - first, copy
