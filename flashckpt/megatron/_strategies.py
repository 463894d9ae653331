"""megatron-core ``dist_checkpointing`` strategies backed by a :class:`MegatronCheckpointer`.

For megatron-core releases that still have ``dist_checkpointing.strategies.base``
(0.16.x). ``dist_checkpointing.save(ssd, ckpt_dir, sharded_strategy=FlashSaveStrategy(ck))``
writes megatron's own small files (``common.pt``, ``metadata.json``) as usual and hands
the sharded part to the flash checkpointer; ``ckpt_dir/flashckpt.json`` records which
flash step holds it. ``dist_checkpointing.load(ssd, ckpt_dir,
sharded_strategy=FlashLoadStrategy(ck))`` reads it back, with any TP/DP layout.
With ``async_sharded_save=True`` the returned ``AsyncRequest`` has no work to run in
the background (the saver process already does it) and waits for storage in its
finalize step, so megatron's ``AsyncCallsQueue`` schedules it like its own.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Union

import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import CheckpointingException, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy, LoadShardedStrategy

from .._errors import CheckpointError
from ..restore._sources import Agreement, Source
from ..storage._url import open_storage
from ..torch._tensors import DTYPE_NAMES
from ._checkpointer import MegatronCheckpointer

__all__ = ["BACKEND", "FlashLoadStrategy", "FlashSaveStrategy"]

BACKEND = "flashckpt"
VERSION = 1
POINTER = "flashckpt.json"
_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def _step_of(checkpoint_dir: str) -> int:
    match = re.search(r"(\d+)$", os.path.basename(os.path.normpath(checkpoint_dir)))
    if match is None:
        raise CheckpointError(f"cannot tell the step of {checkpoint_dir}: name it like iter_0000100 or pass step=")
    return int(match.group(1))


class FlashSaveStrategy(AsyncSaveShardedStrategy):
    """Save strategy: the sharded part of a ``dist_checkpointing.save`` as a flash save.

    ``step`` defaults to the trailing number of the checkpoint directory's name
    (megatron names them ``iter_0000100``). All ranks call ``dist_checkpointing.save``.
    """

    def __init__(self, checkpointer: MegatronCheckpointer, *, step: int | None = None) -> None:
        super().__init__(BACKEND, VERSION)
        self.checkpointer = checkpointer
        self.step = step

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> None:
        self._save(sharded_state_dict, str(checkpoint_dir))

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> AsyncRequest:
        self._save(sharded_state_dict, str(checkpoint_dir))
        return AsyncRequest(None, (), [self.checkpointer.wait])

    def _save(self, sharded_state_dict: Any, checkpoint_dir: str) -> None:
        step = self.step if self.step is not None else _step_of(checkpoint_dir)
        self.checkpointer.save(step, {"sharded": sharded_state_dict})
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(os.path.join(checkpoint_dir, POINTER), "w") as f:
                json.dump({"directory": self.checkpointer.directory, "step": step}, f)


class FlashLoadStrategy(LoadShardedStrategy):
    """Load strategy for checkpoints written with :class:`FlashSaveStrategy`."""

    def __init__(self, checkpointer: MegatronCheckpointer) -> None:
        self.checkpointer = checkpointer

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"{type(self).__name__} reads {BACKEND!r} checkpoints, not {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(f"{BACKEND} checkpoint version {loaded_version} is not {VERSION}")

    def _pointer(self, checkpoint_dir: str) -> int:
        path = os.path.join(checkpoint_dir, POINTER)
        try:
            with open(path) as f:
                pointer = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{checkpoint_dir} has no {POINTER}; it was not saved by FlashSaveStrategy") from None
        if open_storage(pointer["directory"]).root != self.checkpointer.directory:
            raise CheckpointError(f"{checkpoint_dir} points at {pointer['directory']}, this checkpointer "
                                  f"reads {self.checkpointer.directory}")
        return int(pointer["step"])

    def load(self, sharded_state_dict: Any, checkpoint_dir: Union[str, Path]) -> Any:
        step = self._pointer(str(checkpoint_dir))
        state, got = self.checkpointer.load({"sharded": sharded_state_dict}, step=step)
        if got is None:
            raise CheckpointError(f"flash step {step} of {checkpoint_dir} is neither in memory nor committed")
        return state["sharded"]

    def _metadata(self, checkpoint_dir: Union[str, Path], objects: bool) -> dict:
        step = self._pointer(str(checkpoint_dir))
        reader = self.checkpointer._reader(Agreement(step, Source.STORAGE, None))
        try:
            out: dict = {}
            for key, saved in reader.shards.items():
                shape, dtype = saved[0].global_shape, _DTYPES[saved[0].entry.dtype]
                out[key] = ShardedTensor(key, None, dtype, shape, shape, (0,) * len(shape), None)
            if objects:
                for unique_key in reader.objects:
                    obj = ShardedObject.empty_from_unique_key(unique_key)
                    out[obj.unique_key] = obj
            return out
        finally:
            reader.close()

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> dict:
        return self._metadata(checkpoint_dir, objects=False)

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> dict:
        return self._metadata(checkpoint_dir, objects=True)
