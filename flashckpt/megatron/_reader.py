"""The saved blocks of one megatron step, read by the resharding reader.

Each saved rank's tree is ``{"megatron": {"layout": "[...]", "data": [...], "objects": {...},
"common": ...}}`` (see ``_checkpointer``): the main-replica local blocks of each
``ShardedTensor``, their keys and global offsets as one JSON string. A :class:`StepReader`
indexes every rank's shard header (without reading bodies) as a
:class:`flashckpt.restore._reshard.Source` whose blocks are those pieces, and fills all requested
blocks with one :meth:`~flashckpt.restore._reshard.RangeReader.fill_many`: the byte ranges they
need, merged per shard and read on several threads straight into the model's tensors.
Sources are the committed shards (the blocks read verified) or, for a restart with the same
layout, the shared-memory images of this node's ranks
(:class:`~flashckpt.restore._shard_read.MemoryImage`) and, on node-local directories, the
shards of this node's ranks that the agreement reads from the node's own directory
(``Agreement.own_disk``).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ..memory._format import Entry
from ..restore._reshard import Fill, Piece, RangeReader, Source, close_sources
from ..restore._shard_read import unflatten
from ..torch._tensors import DTYPE_NAMES

__all__ = ["BYTESIO", "StepReader"]

BYTESIO = "__flashckpt_bytesio__"
_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class _Saved:
    source: Source
    piece: Piece
    entry: Entry
    global_shape: tuple[int, ...]


def _blocks(mg: dict) -> list[tuple]:
    """``(key, global_offset, shape, global_shape, data)`` of every saved block: format 2
    keeps the places as one JSON string beside a list of tensors, format 1 a dict each."""
    if "layout" in mg:
        return [(*place, data) for place, data in zip(json.loads(mg["layout"]), mg["data"], strict=True)]
    return [(s["key"], s["global_offset"], s["shape"], s["global_shape"], s["data"]) for s in mg["shards"]]


class StepReader:
    """Every saved rank's blocks of one step, and reads of requested blocks from them.
    Closes the sources when it closes."""

    def __init__(self, sources: list[Source], *, allow_pickle: bool) -> None:
        self.sources = sources
        self.allow_pickle = allow_pickle
        self.shards: dict[str, list[_Saved]] = {}
        self.objects: dict[str, tuple[Source, Any]] = {}
        self.common: tuple[Source, Any] | None = None
        for source in sources:
            tree = unflatten(source.image.meta["tree"], lambda name: ("__tensor__", name),
                             lambda blob: ("__pickled__", blob))
            try:
                mg = tree["megatron"]
            except (KeyError, TypeError):
                raise CorruptCheckpointError(f"{source.path}: not a megatron flash checkpoint") from None
            source.blocks = {}
            for key, offset, shape, global_shape, data in _blocks(mg):
                piece = Piece(tuple(offset), tuple(shape))
                source.blocks.setdefault(key, []).append((piece, data[1]))
                self.shards.setdefault(key, []).append(
                    _Saved(source, piece, source.entries[data[1]], tuple(global_shape)))
            for key, value in mg["objects"].items():
                self.objects.setdefault(key, (source, value))
            if mg.get("common") is not None and self.common is None:
                self.common = (source, mg["common"])

    def close(self) -> None:
        close_sources(self.sources)

    # -- tensors ------------------------------------------------------------------

    def _covered(self, key: str, want: Piece) -> int:
        return sum(common.numel for s in self.shards.get(key, ()) if (common := s.piece.intersect(want)))

    def covers(self, key: str, want: Piece) -> bool:
        """Whether the saved blocks of ``key`` hold every element of ``want``."""
        return self._covered(key, want) == want.numel

    def mismatch(self, key: str, want: Piece, global_shape: tuple[int, ...], dtype: torch.dtype,
                 allow_shape_mismatch: bool = False) -> str | None:
        """Why the global block ``want`` of ``key`` cannot be read (None: it can)."""
        saved = self.shards.get(key)
        if not saved:
            return f"{key}: not in the checkpoint"
        if not allow_shape_mismatch and saved[0].global_shape != global_shape:
            return f"{key}: checkpoint has global shape {list(saved[0].global_shape)}, the model {list(global_shape)}"
        if len(saved[0].piece.offsets) != len(want.offsets):
            return (f"{key}: checkpoint blocks have {len(saved[0].piece.offsets)} dimensions, "
                    f"the model's {len(want.offsets)}")
        name = DTYPE_NAMES.get(dtype)
        if saved[0].entry.dtype != name:
            return f"{key}: checkpoint has dtype {saved[0].entry.dtype}, the model {name}"
        covered = self._covered(key, want)
        if covered != want.numel:
            return (f"{key}: the checkpoint holds {covered} of the {want.numel} elements "
                    f"of block offset={list(want.offsets)} shape={list(want.lengths)}")
        return None

    def fill_many(self, fills: list[Fill]) -> None:
        """Read every requested block (see :meth:`RangeReader.fill_many`)."""
        RangeReader(self.sources).fill_many(fills)

    # -- whole subtrees (objects, common) --------------------------------------------

    def materialize(self, source: Source, value: Any) -> Any:
        """A stored subtree with its tensors read whole and BytesIO / pickled leaves rebuilt."""

        def build(v: Any) -> Any:
            if isinstance(v, tuple) and len(v) == 2 and v[0] == "__tensor__":
                e = source.entries[v[1]]
                t = torch.empty(e.shape, dtype=_DTYPES[e.dtype])
                if e.nbytes:
                    source.reader.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy()), source.file_offset(e))
                return t
            if isinstance(v, tuple) and len(v) == 2 and v[0] == "__pickled__":
                if not self.allow_pickle:
                    raise CheckpointError(f"{source.path} holds pickled objects; pass allow_pickle=True to load "
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
