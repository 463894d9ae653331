"""Reading one committed shard from storage into the caller's tensors, verified."""

from __future__ import annotations

import struct
from typing import Any, Callable

from ._checksum import StreamCheck
from ._errors import CorruptCheckpointError
from ._format import Entry, Image, parse_header
from ._storage import LocalStorage
from ._tree import Merge, kind_named

__all__ = ["read_shard_into"]

_READ_CHUNK = 64 << 20


def read_shard_into(storage: LocalStorage, step: int, rank: int, merge: Callable[[Image], Merge]) -> None:
    """Read shard ``rank`` of committed ``step`` into the tensors ``merge`` picks for the
    shard's entries, checking its checksums; plain leaves are applied only once it verifies."""
    f, record = storage.open_shard(step, rank)
    path = f.name
    with f:
        size = record["size"]
        head = _read_exact(f, 8, path)
        (n,) = struct.unpack("<Q", head)
        head += _read_exact(f, min(n, size - 8), path)
        image = parse_header(head, path, size)
        fills = merge(image)
        targets: dict[str, list[Any]] = {}
        for name, obj in fills.fills:
            targets.setdefault(name, []).append(obj)
        kinds = image.meta["kinds"]
        check = StreamCheck(record, path)
        check.update(head)
        pos = len(head)
        for entry in image.entries:  # sorted by offset
            at = len(image.header) + entry.offset
            if at > pos:
                check.update(_read_exact(f, at - pos, path))
            kind = kind_named(kinds[entry.name])
            target, *ties = targets.get(entry.name) or [kind.empty(entry.dtype, entry.shape)]
            view = kind.host_bytes(target)
            scratch = None
            if view is None:
                scratch = bytearray(entry.nbytes)
                view = memoryview(scratch)
            _readinto_exact(f, view, path)
            check.update(view)
            if scratch is not None:
                kind.copy([target], kind.views(scratch, 0, [Entry(entry.name, entry.dtype, entry.shape, 0, entry.nbytes)]))
            kind.copy(ties, [target] * len(ties))
            pos = at + entry.nbytes
        while chunk := f.read(_READ_CHUNK):
            check.update(chunk)
    check.finish()  # a mismatch names the bytes; an older step may still load
    fills.apply_plain()


def _read_exact(f, n: int, path: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CorruptCheckpointError(f"{path}: truncated (wanted {n} more bytes, got {len(data)})")
    return data


def _readinto_exact(f, view: memoryview, path: str) -> None:
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CorruptCheckpointError(f"{path}: truncated inside the tensor data")
        done += n
