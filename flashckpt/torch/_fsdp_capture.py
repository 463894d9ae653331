"""The tree a failure capture of an FSDP2 model saves: this rank's local shards, kept
ready by the main thread, handed to the engine from any thread without a collective."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._errors import CheckpointError
from ._fsdp_state import SaveCache, Target, all_live, fsdp_api


class CaptureShards:
    """This rank's local shards of the model and optimizer a failure capture saves, as a
    tree that any thread can hand the engine: a save's tree, collected on the main thread
    (at arming, and at the end of the first optimizer step after it or after a load, or after
    one that gave the optimizer's state more tensors), whose tensors are the live sharded
    parameters, buffers and optimizer states. A capture checks that they still are."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, collect: Callable[[], Target],
                 collecting: Callable[[], bool]) -> None:
        """``collect()`` gives the tree of a save; ``collecting()`` is true inside any
        collect, where a fresh optimizer's state is made by a step whose hook must not collect."""
        fsdp1 = [name or "the model" for name, m in model.named_modules() if isinstance(m, fsdp_api().FSDP1)]
        if fsdp1:
            raise CheckpointError(f"save_on_failure: {fsdp1[0]} is FSDP1 (FullyShardedDataParallel), which has no "
                                  "failure capture: its sharded state dict is collective (at a failure a peer may be "
                                  "dead or blocked) and a copy; use FSDP2 (fully_shard)")
        self.model, self.optimizer, self._collect, self._collecting = model, optimizer, collect, collecting
        target = collect()
        self._cache = SaveCache.of(self._count(), target)
        if not all_live(self._cache.target, list(model.parameters()) + list(model.buffers()), optimizer):
            raise CheckpointError("save_on_failure: the model's state dict holds copies, not its live parameters "
                                  "(not FSDP2): a capture could not read them without the model")
        if not self._live(self._cache.target):
            raise CheckpointError("save_on_failure: the model has parameters the optimizer does not hold (frozen "
                                  "ones); failure capture needs every parameter in the optimizer")
        self.stale = True
        """Collect again at the end of the next optimizer step (after arming, after a load)."""
        self._handle = optimizer.register_step_post_hook(lambda *_: self._refresh())

    def _count(self) -> tuple[int]:
        return (len(self.optimizer.state),)

    def _live(self, target: Target) -> bool:
        """Read without the model's parameters, which FSDP2 swaps for unsharded ones."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return all_live(target, params + list(self.model.buffers()), self.optimizer)

    def _refresh(self) -> None:
        """The optimizer's step post-hook (main thread; registered before the capture's, so
        no capture sees the step as ended before this ran)."""
        if not self._collecting() and (self.stale or self._cache.key != self._count()):
            target = self._collect()
            self._cache, self.stale = SaveCache.of(self._count(), target), False

    def tree(self, extra: Any) -> dict[str, Any]:
        """What the capture saves (any thread, no collective)."""
        cache = self._cache
        if cache.key != self._count() or not self._live(cache.target):
            raise CheckpointError("the optimizer's state or the model's buffers are other tensors than at the end "
                                  "of the last optimizer step (replaced since)")
        return cache.tree(self.optimizer, extra)

    def close(self) -> None:
        self._handle.remove()
