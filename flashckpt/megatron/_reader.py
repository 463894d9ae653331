"""Reading the global ranges a rank needs out of the shards of one saved step.

Each saved rank's tree is ``{"megatron": {"layout": "[...]", "data": [...], "objects": {...},
"common": ...}}`` (see ``_checkpointer``): the main-replica local blocks of each
``ShardedTensor``, their keys and global offsets as one JSON string. A
:class:`StepReader` indexes every rank's shard header (without reading bodies) and fills a requested block by reading, from each
saved block it intersects, only the contiguous byte runs that hold the intersection.
Sources are the committed safetensors files (through the one shard reader) or, for a restart with
the same layout, this rank's own shared-memory image.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from .._files import open_regular
from .._format import Entry, Image, header_length, parse_header
from .._shard_read import ShardReader, unflatten
from ..torch._tensors import DTYPE_NAMES
from ._layout import Box, intersect, read_runs, volume

__all__ = ["Source", "FileSource", "MemorySource", "StepReader", "BYTESIO"]

BYTESIO = "__flashckpt_bytesio__"
_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


class Source(Protocol):
    """The bytes of one saved rank's image."""

    where: str
    image: Image

    def readinto(self, view: memoryview, body_offset: int) -> None: ...


class FileSource:
    """A committed ``rank-R.safetensors`` read through its :class:`ShardReader` (exact
    reads, the blocks touched verified, the header's blocks on opening).

    ``shard`` is what a storage's ``open_shard`` returns (a file, an object-store shard) (the source owns and closes
    it), or a path, opened as a regular file only (no symlink, FIFO or device)."""

    def __init__(self, shard: Any, record: dict) -> None:
        if isinstance(shard, str):
            path, shard = shard, io.FileIO(open_regular(shard, shard), "rb", closefd=True)
            shard.name = path
        self._reader = ShardReader(shard, record)
        self.where, self.image = self._reader.path, self._reader.image
        try:
            self._reader.verify_header()
        except BaseException:
            self._reader.close()
            raise

    def readinto(self, view: memoryview, body_offset: int) -> None:
        """Read ``view`` from the tensor data, verifying the checksums of the blocks it touches."""
        self._reader.readinto(view, self._reader.body_start + body_offset)

    def close(self) -> None:
        self._reader.close()


class MemorySource:
    """A rank's shared-memory image of the step on this node (a restart, same layout)."""

    def __init__(self, slot: Any, base: int, where: str) -> None:
        self.where = where
        self._slot, self._base = slot, base
        n = header_length(memoryview(slot.mm)[base:base + 8], where)
        self.image = parse_header(memoryview(slot.mm)[base:base + 8 + n], where)

    def readinto(self, view: memoryview, body_offset: int) -> None:
        at = self._base + len(self.image.header) + body_offset
        view[:] = memoryview(self._slot.mm)[at:at + len(view)]

    def close(self) -> None:
        self._slot.close()


@dataclass(frozen=True, slots=True)
class _Saved:
    source: Source
    box: Box
    entry: Entry
    global_shape: tuple[int, ...]


def _blocks(mg: dict) -> list[tuple]:
    """``(key, global_offset, shape, global_shape, data)`` of every saved block: format 2
    keeps the places as one JSON string beside a list of tensors, format 1 a dict each."""
    if "layout" in mg:
        return [(*place, data) for place, data in zip(json.loads(mg["layout"]), mg["data"], strict=True)]
    return [(s["key"], s["global_offset"], s["shape"], s["global_shape"], s["data"]) for s in mg["shards"]]


class StepReader:
    """Every saved rank's layout of one step, and reads of requested blocks from it."""

    def __init__(self, sources: list[Source], *, allow_pickle: bool) -> None:
        self.sources = sources
        self.allow_pickle = allow_pickle
        self.shards: dict[str, list[_Saved]] = {}
        self.objects: dict[str, tuple[Source, Any]] = {}
        self.common: tuple[Source, Any] | None = None
        for source in sources:
            entries = {e.name: e for e in source.image.entries}
            tree = unflatten(source.image.meta["tree"], lambda name: ("__tensor__", name),
                             lambda blob: ("__pickled__", blob))
            try:
                mg = tree["megatron"]
            except (KeyError, TypeError):
                raise CorruptCheckpointError(f"{source.where}: not a megatron flash checkpoint") from None
            for key, offset, shape, global_shape, data in _blocks(mg):
                self.shards.setdefault(key, []).append(
                    _Saved(source, Box(tuple(offset), tuple(shape)), entries[data[1]], tuple(global_shape)))
            for key, value in mg["objects"].items():
                self.objects.setdefault(key, (source, value))
            if mg.get("common") is not None and self.common is None:
                self.common = (source, mg["common"])

    def close(self) -> None:
        for source in self.sources:
            source.close()

    # -- tensors ------------------------------------------------------------------

    def covers_locally(self, key: str, box: Box) -> bool:
        return sum(volume(i.shape) for s in self.shards.get(key, ()) if (i := intersect(box, s.box))) == volume(box.shape)

    def fill(self, key: str, box: Box, global_shape: tuple[int, ...], dest: torch.Tensor,
             allow_shape_mismatch: bool = False) -> None:
        """Read the global block ``box`` of ``key`` into ``dest`` (a CPU tensor of that block)."""
        saved = self.shards.get(key)
        if not saved:
            raise StateMismatchError(f"{key}: not in the checkpoint")
        if not allow_shape_mismatch and saved[0].global_shape != tuple(global_shape):
            raise StateMismatchError(f"{key}: checkpoint has global shape {list(saved[0].global_shape)}, "
                                     f"the model {list(global_shape)}")
        want = DTYPE_NAMES.get(dest.dtype)
        if saved[0].entry.dtype != want:
            raise StateMismatchError(f"{key}: checkpoint has dtype {saved[0].entry.dtype}, the model {want}")
        whole = dest.view(box.shape)
        covered = 0
        for s in saved:
            part = intersect(box, s.box)
            if part is None:
                continue
            direct = part == box and dest.is_contiguous()
            buf = whole if direct else torch.empty(part.shape, dtype=dest.dtype)
            self._read(s, part, buf)
            if not direct:
                rel = tuple(slice(p - o, p - o + n) for p, o, n in zip(part.offset, box.offset, part.shape))
                whole[rel].copy_(buf)
            covered += volume(part.shape)
        if covered != volume(box.shape):
            raise StateMismatchError(f"{key}: the checkpoint holds {covered} of the {volume(box.shape)} elements "
                                     f"of block offset={list(box.offset)} shape={list(box.shape)}")

    @staticmethod
    def _read(saved: _Saved, part: Box, buf: torch.Tensor) -> None:
        item = buf.element_size()
        run, starts = read_runs(saved.box, part)
        flat = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
        pos, i = 0, 0
        while i < len(starts):  # coalesce runs that are adjacent in the file
            j = i
            while j + 1 < len(starts) and starts[j + 1] == starts[j] + run:
                j += 1
            nbytes = (j - i + 1) * run * item
            saved.source.readinto(flat[pos:pos + nbytes], saved.entry.offset + starts[i] * item)
            pos += nbytes
            i = j + 1

    # -- whole subtrees (objects, common) --------------------------------------------

    def materialize(self, source: Source, value: Any) -> Any:
        """A stored subtree with its tensors read whole and BytesIO / pickled leaves rebuilt."""
        entries = {e.name: e for e in source.image.entries}

        def build(v: Any) -> Any:
            if isinstance(v, tuple) and len(v) == 2 and v[0] == "__tensor__":
                e = entries[v[1]]
                t = torch.empty(e.shape, dtype=_DTYPES[e.dtype])
                if e.nbytes:
                    source.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy()), e.offset)
                return t
            if isinstance(v, tuple) and len(v) == 2 and v[0] == "__pickled__":
                if not self.allow_pickle:
                    raise CheckpointError(f"{source.where} holds pickled objects; pass allow_pickle=True to load "
                                          "them (only for checkpoints you trust)")
                import base64
                import pickle
                return pickle.loads(base64.b64decode(v[1]))
            if isinstance(v, dict):
                if set(v) == {BYTESIO}:
                    return io.BytesIO(build(v[BYTESIO]).numpy().tobytes())
                return {k: build(x) for k, x in v.items()}
            if isinstance(v, list):
                return [build(x) for x in v]
            if isinstance(v, tuple):
                return tuple(build(x) for x in v)
            return v

        return build(value)

    def sharded_object(self, unique_key: str) -> Any:
        found = self.objects.get(unique_key)
        if found is None:
            raise StateMismatchError(f"sharded object {unique_key}: not in the checkpoint")
        return self.materialize(*found)

    def common_state(self) -> dict:
        if self.common is None:
            return {}
        return self.materialize(*self.common)
