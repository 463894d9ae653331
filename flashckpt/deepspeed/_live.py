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
from typing import Any

import torch
from deepspeed.utils import logger as ds_logger

from ..memory._copy import overlapping
from ..restore._shard_read import unflatten
from ..memory._tree import Places
from ..torch._tensors import _DTYPES
from . import _objects
from ._engine import FlashCheckpointEngine

__all__ = ["CAPTURE_TAG", "agreed_layout", "live_places"]

CAPTURE_TAG = "flashckpt-live"

log = logging.getLogger(__name__)


def live_places(engine: Any, scratch: str, tag: str, saved_files: dict[str, Any]) -> Places:
    """Tree path of a leaf of the flash state (``deepspeed/files/<tag>/<file>/...``) ->
    the engine's tensor holding that leaf now, where the live state dicts have the saved
    layout (``saved_files``: the encoded ``files`` of :func:`agreed_layout`; an ordered dict
    only with the same keys in the same order). All ranks call this (DeepSpeed's save
    synchronises them); ``scratch`` (a new directory) is where DeepSpeed's save may put
    its recovery script, removed after. Only CPU tensors with bytes of their own are
    offered: one sharing bytes with another tensor would be written twice."""
    captured: dict[str, Any] = {}
    capture = FlashCheckpointEngine(lambda _tag, _dir, files, _latest: captured.update(files))
    installed, engine.checkpoint_engine = engine.checkpoint_engine, capture
    level = ds_logger.level
    ds_logger.setLevel(max(level, logging.WARNING))  # its "Saving model checkpoint" lines would mislead
    try:
        engine.save_checkpoint(scratch, tag=CAPTURE_TAG, client_state={}, save_latest=False)
    finally:
        ds_logger.setLevel(level)
        engine.checkpoint_engine = installed
        shutil.rmtree(scratch, ignore_errors=True)
    matched: dict[str, torch.Tensor] = {}
    every: dict[str, torch.Tensor] = {}
    for rel, state_dict in captured.items():
        name = os.path.join(tag, os.path.relpath(rel, CAPTURE_TAG))
        live = _objects.encode(state_dict)
        _collect(live, live, f"deepspeed/files/{name}", every)
        if name in saved_files:
            _collect(live, saved_files[name], f"deepspeed/files/{name}", matched)
    offered = _own_bytes(matched, every)
    log.debug("the load may fill %d of the engine's %d tensors in place", len(offered), len(every))
    return offered.get


def agreed_layout(flash: Any, agreement: Any) -> dict[str, Any]:
    """The ``deepspeed`` part of this rank's copy of the agreed step (in memory, or in its
    own node-local directory: ``flash.agreed_image``), its tensors as meta tensors (shape and
    dtype, no bytes): what the load's checks read, before any copy."""
    image = flash.agreed_image(agreement)
    entries = {e.name: e for e in image.entries}

    def leaf(name: str) -> torch.Tensor:
        return torch.empty(entries[name].shape, dtype=_DTYPES[entries[name].dtype], device="meta")

    return unflatten(image.meta["tree"], leaf, lambda _blob: None)["deepspeed"]


def _collect(live: Any, saved: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``live`` by its tree path (the paths ``merge_into`` walks) where
    ``saved`` has a tensor at the same path, walking both together."""
    if isinstance(live, torch.Tensor):
        if isinstance(saved, torch.Tensor):
            out[path] = live
    elif isinstance(live, dict) and isinstance(saved, dict):
        if (live.get(_objects.TAG) or saved.get(_objects.TAG)) and \
                (live.get(_objects.TAG) != saved.get(_objects.TAG) or live.get("keys") != saved.get("keys")):
            return  # an ordered dict's leaves go by position: only the same keys in the same order match
        for k, v in live.items():
            if k in saved:
                _collect(v, saved[k], f"{path}/{k}", out)
    elif isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
        for i, (v, w) in enumerate(zip(live, saved)):
            _collect(v, w, f"{path}/{i}", out)


def _own_bytes(candidates: dict[str, torch.Tensor], every: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The contiguous, non-empty CPU tensors among ``candidates`` whose bytes no other
    tensor of ``every`` (contiguous or not) shares in part; the same view under two paths is
    one tensor, kept. Detached, so that a load may write into them."""
    spans: dict[tuple[int, int, Any, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for path, t in every.items():
        if t.device.type == "cpu" and t.numel():
            extent = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
            start = t.data_ptr()
            paths = spans.setdefault((start, start + extent * t.element_size(), t.dtype, tuple(t.shape), t.stride()),
                                     [])
            if path in candidates:
                paths.append(path)
    dropped = overlapping((span[0], span[1], span) for span in spans)
    return {path: candidates[path].detach() for span, paths in spans.items() if span not in dropped
            for path in paths if candidates[path].is_contiguous()}
