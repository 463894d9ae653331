"""The DeepSpeed engine's own tensors as the destinations of a load from memory.

A load into new tensors touches every page of them for the first time (on this kind of
machine that costs more than the copy from shared memory), and DeepSpeed then copies
them into the engine anyway. The engine's current tensors, handed to the load as the
places of the same leaves, are filled in place instead: module parameters, the ZeRO fp32
partitions and the optimizer's moments. DeepSpeed's ``load_checkpoint`` then reads them
as before; the torch optimizer is handed back the very tensors it holds.

The live state dicts come from ``engine.save_checkpoint`` with a capturing checkpoint
engine (DeepSpeed builds them by reference, as for a flash save), so a leaf's path in
them is its path in the saved tree.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

import torch
from deepspeed.utils import logger as ds_logger

from .._shard_read import unflatten
from .._tree import Places
from ..torch._tensors import _DTYPES
from . import _objects
from ._engine import FlashCheckpointEngine

__all__ = ["CAPTURE_TAG", "live_places", "memory_layout"]

CAPTURE_TAG = "flashckpt-live"

log = logging.getLogger(__name__)


def live_places(engine: Any, scratch_root: str, tag: str) -> Places:
    """Tree path of a leaf of the flash state (``deepspeed/files/<tag>/<file>/...``) ->
    the engine's tensor holding that leaf now. All ranks call this (DeepSpeed's save
    synchronises them). Only CPU tensors with bytes of their own are offered: one whose
    bytes overlap another offered tensor's would be written twice."""
    captured: dict[str, Any] = {}
    capture = FlashCheckpointEngine(lambda _tag, _dir, files, _latest: captured.update(files))
    scratch = tempfile.mkdtemp(prefix=".live-", dir=scratch_root)
    installed, engine.checkpoint_engine = engine.checkpoint_engine, capture
    level = ds_logger.level
    ds_logger.setLevel(max(level, logging.WARNING))  # its "Saving model checkpoint" lines would mislead
    try:
        engine.save_checkpoint(scratch, tag=CAPTURE_TAG, client_state={}, save_latest=False)
    finally:
        ds_logger.setLevel(level)
        engine.checkpoint_engine = installed
        shutil.rmtree(scratch, ignore_errors=True)
    tensors: dict[str, torch.Tensor] = {}
    for rel, state_dict in captured.items():
        name = os.path.relpath(rel, CAPTURE_TAG)
        _collect(_objects.encode(state_dict), f"deepspeed/files/{os.path.join(tag, name)}", tensors)
    offered = _own_bytes(tensors)
    log.debug("the load may fill %d of the engine's %d tensors in place", len(offered), len(tensors))
    return offered.get


def memory_layout(flash: Any, step: int) -> dict[str, Any]:
    """The ``deepspeed`` part of this rank's in-memory copy of ``step``, its tensors as meta
    tensors (shape and dtype, no bytes): what the load's checks read, before any copy."""
    image = flash.memory_image(step)
    entries = {e.name: e for e in image.entries}

    def leaf(name: str) -> torch.Tensor:
        return torch.empty(entries[name].shape, dtype=_DTYPES[entries[name].dtype], device="meta")

    return unflatten(image.meta["tree"], leaf, lambda _blob: None)["deepspeed"]


def _collect(obj: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``obj`` by its tree path (the paths ``merge_into`` walks)."""
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _collect(v, f"{path}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _collect(v, f"{path}/{i}", out)


def _own_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors among ``tensors`` on the CPU, contiguous, not empty, whose bytes no other
    tensor shares in part (the same view under two paths is one tensor, kept); detached."""
    views: dict[tuple[int, int, Any, tuple[int, ...]], list[str]] = {}
    for path, t in tensors.items():
        if t.device.type == "cpu" and t.is_contiguous() and t.numel():
            start = t.data_ptr()
            views.setdefault((start, start + t.numel() * t.element_size(), t.dtype, tuple(t.shape)), []).append(path)
    dropped: set[tuple[Any, ...]] = set()
    furthest: tuple[int, int, Any, tuple[int, ...]] | None = None  # of the views so far, the one ending last
    for view in sorted(views, key=lambda v: (v[0], v[1])):
        if furthest is not None and view[0] < furthest[1]:
            dropped.update((view, furthest))
        if furthest is None or view[1] > furthest[1]:
            furthest = view
    return {path: tensors[path].detach() if tensors[path].requires_grad else tensors[path]
            for view, paths in views.items() if view not in dropped for path in paths}
