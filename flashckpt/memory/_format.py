"""The shard format: a safetensors image, byte-identical in shared memory and on disk.

Layout: 8-byte little-endian header length, the JSON header padded with spaces so
that the body starts 64-byte aligned, then the body. Tensors are sorted by item size
(largest first) so each stays naturally aligned; within one item size the small ones
(under :data:`SMALL_BYTES`: optimizer step counters, biases, norms) come first,
smallest first, so that they share the header's checksum block: a resharding rank
that takes only those from a shard reads that block, not one block per tensor. The
tree skeleton and the plain values travel as JSON in ``__metadata__["flashckpt"]``, so
any safetensors reader can open the file and flashckpt can rebuild the nested state.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from typing import Any

from .._errors import CorruptCheckpointError

__all__ = ["ALIGN", "DTYPE_SIZES", "Entry", "Image", "checked_entries", "header_length", "plan_image", "parse_header"]

ALIGN = 64
FORMAT = "flashckpt/1"
META_KEY = "flashckpt"
MAX_HEADER = 100 * 1024 * 1024  # the bound safetensors itself enforces
SMALL_BYTES = 64 << 10

DTYPE_SIZES = {
    "F64": 8, "I64": 8, "U64": 8, "C64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset inside the body."""
    nbytes: int


@dataclass(frozen=True, slots=True)
class Image:
    """A planned safetensors image: the encoded header and where each tensor goes."""

    header: bytes
    """Length prefix plus padded JSON; the body starts at ``len(header)``."""
    entries: list[Entry]
    body_size: int
    meta: dict[str, Any]

    @property
    def size(self) -> int:
        return len(self.header) + self.body_size


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_image(tensors: list[tuple[str, str, tuple[int, ...]]], meta: dict[str, Any]) -> Image:
    """Lay out ``(name, dtype, shape)`` tensors and encode the header with ``meta``."""
    entries, encoded, size = _plan_entries(tuple((name, dtype, tuple(shape)) for name, dtype, shape in tensors))
    metadata = json.dumps({"__metadata__": {META_KEY: json.dumps(meta, separators=(",", ":"))}}, separators=(",", ":"))
    raw = (metadata[:-1] + encoded + "}").encode() if encoded else metadata.encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    return Image(struct.pack("<Q", len(raw)) + raw, entries, size, meta)


@functools.lru_cache(maxsize=8)
def _plan_entries(tensors: tuple[tuple[str, str, tuple[int, ...]], ...]) -> tuple[list[Entry], str, int]:
    """The entries of ``tensors`` (largest dtypes first; small ones first within each,
    smallest first), their header JSON (``,"name":{...}`` each) and the body size.
    Cached: a training job saves the same layout again and again."""
    def place(i: int) -> tuple[int, bool, int]:
        size = DTYPE_SIZES[tensors[i][1]]
        nbytes = _numel(tensors[i][2]) * size
        return -size, nbytes >= SMALL_BYTES, min(nbytes, SMALL_BYTES)

    order = sorted(range(len(tensors)), key=place)
    entries: list[Entry] = []
    offset = 0
    for i in order:
        name, dtype, shape = tensors[i]
        nbytes = _numel(shape) * DTYPE_SIZES[dtype]
        entries.append(Entry(name, dtype, shape, offset, nbytes))
        offset += nbytes
    encoded = "".join("," + json.dumps({e.name: {"dtype": e.dtype, "shape": list(e.shape),
                                                  "data_offsets": [e.offset, e.offset + e.nbytes]}},
                                       separators=(",", ":"))[1:-1] for e in entries)
    return entries, encoded, offset


def header_length(buf: Any, where: str) -> int:
    """The JSON length that the first 8 bytes of ``buf`` announce, bounded like safetensors."""
    if len(buf) < 8:
        raise CorruptCheckpointError(f"{where}: truncated ({len(buf)} bytes, no header)")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > MAX_HEADER:
        raise CorruptCheckpointError(f"{where}: header length {n} is invalid")
    return n


def parse_header(buf: bytes | memoryview, where: str, total_size: int | None = None) -> Image:
    """Parse a safetensors header from the start of ``buf`` (at least 8 bytes + header),
    held to safetensors' own rules (:func:`checked_entries`).

    ``where`` names the file or segment in error messages; ``total_size`` is the length
    of the whole image (the file's, the segment's): its body must end exactly where the
    last tensor does. None: ``buf`` may hold the header alone, and the body is not checked.
    """
    n = header_length(buf, where)
    if 8 + n > len(buf):
        raise CorruptCheckpointError(f"{where}: header length {n} is invalid or the file is truncated")
    try:
        header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
        metadata = header.pop("__metadata__")
        meta = json.loads(metadata[META_KEY])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where}: not a flashckpt safetensors header ({exc!r})") from exc
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(f"{where}: not a flashckpt safetensors header (its __metadata__ is not "
                                     "a map of strings holding a JSON object)")
    entries = checked_entries(header, where)
    body_size = entries[-1].offset + entries[-1].nbytes if entries else 0
    if total_size is not None and 8 + n + body_size != total_size:
        if 8 + n + body_size > total_size:
            raise CorruptCheckpointError(
                f"{where}: truncated: header promises {8 + n + body_size} bytes, file has {total_size}")
        raise CorruptCheckpointError(f"{where}: {total_size - 8 - n - body_size} bytes past the last tensor: the "
                                     f"header's tensors end at byte {8 + n + body_size}, the file has {total_size}")
    return Image(bytes(buf[:8 + n]), entries, body_size, meta)


def checked_entries(tensors: dict[str, Any], where: str) -> list[Entry]:
    """The entries of a decoded safetensors header's tensors (``__metadata__`` taken out)
    in body order, held to the rules safetensors itself checks before it reads a byte:
    each has a known dtype, a shape of non-negative integers and two integer offsets;
    sorted by offsets they tile the body from byte 0, no gap and no overlap; each spans
    exactly prod(shape) x itemsize bytes. flashckpt's images (:func:`plan_image`: the
    tensors back to back from 0, the alignment comes from the header's padding) and stock
    safetensors files pass; any other layout is a :class:`CorruptCheckpointError` naming
    ``where`` and the tensor."""
    entries = []
    for name, info in tensors.items():
        dtype, shape, offsets = (info.get("dtype"), info.get("shape"), info.get("data_offsets")) \
            if isinstance(info, dict) else (None, None, None)
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} has no known dtype ({dtype!r})")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CorruptCheckpointError(f"{where}: tensor {name!r} has an invalid shape ({shape!r})")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
            raise CorruptCheckpointError(f"{where}: tensor {name!r} has invalid data offsets ({offsets!r})")
        entries.append(Entry(name, dtype, tuple(shape), offsets[0], offsets[1] - offsets[0]))
    entries.sort(key=lambda e: (e.offset, e.nbytes))
    at = 0
    for e in entries:
        if e.offset != at or e.nbytes < 0:
            raise CorruptCheckpointError(
                f"{where}: invalid offset for tensor {e.name!r}: bytes {e.offset}-{e.offset + e.nbytes} of the body, "
                f"where the tensors before it end at byte {at} (tensors must tile the body: no gap, no overlap)")
        if e.nbytes != _numel(e.shape) * DTYPE_SIZES[e.dtype]:
            raise CorruptCheckpointError(f"{where}: tensor {e.name!r} spans {e.nbytes} bytes, its shape "
                                         f"{list(e.shape)} of {e.dtype} takes {_numel(e.shape) * DTYPE_SIZES[e.dtype]}")
        at += e.nbytes
    return entries
