"""Failure capture for the Trainer (``FlashCheckpointCallback(save_on_failure=True)``).

The boundary is the Trainer's own: ``on_pre_optimizer_step`` begins an update and
``on_step_end`` ends it, when model, optimizer, scheduler and ``global_step`` are of one
step (the RNG states are taken there, so a capture holds those of step k, not of the
next step's forward). Under the Trainer's DeepSpeed integration accelerate runs
``engine.step`` inside ``backward``, before ``on_pre_optimizer_step``, so the wrapped
``engine.step`` begins the update there, and the capture runs DeepSpeed's save without
its collectives (``flashckpt.deepspeed._engine.local_only``). A capture is saved like a
Trainer save, so the saver writes it out as its ``checkpoint-<N>`` folder; see
:mod:`flashckpt._capture`.

Under ZeRO-3 every rank captures its own partitions of parameters and optimizer state
(DeepSpeed's tag, ``global_step<N>/``) and the Trainer's state, but not the consolidated
weights: gathering them is a collective, and a peer may be dead. So a captured folder
lacks ``model.safetensors`` even with ``stage3_gather_16bit_weights_on_model_save`` (only
regular saves write it); it holds the tag, ``latest``, ``zero_to_fp32.py``,
``config.json``, ``trainer_state.json``, the RNG states, ``training_args.bin`` and
``scheduler.pt`` where the stock save writes it. A ZeRO-3 resume reads the tag, not the
weights file, so ``resume_from_checkpoint`` continues from it exactly; the weights file
comes from ``zero_to_fp32.py`` or the next regular save. With ``save_only_model`` and
gathered weights the stock save is the weights file alone, so nothing is captured then.

The model's buffers (BatchNorm's statistics), which the next step's forward may have moved
before a capture, are copied at ``on_step_end`` and written in their place, in the model
files and in DeepSpeed's tag alike (``flashckpt._boundary.ModuleBuffers``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .._base import EngineCheckpointer
from .._boundary import ModuleBuffers
from .._capture import FailureCapture
from . import _deepspeed
from ._capture import capture_main_state, capture_rank_state

__all__ = ["TrainerCapture"]

log = logging.getLogger("flashckpt.hf")


class TrainerCapture:
    """One ``train()``'s capture: built in ``on_train_begin`` (main thread), told the
    boundary by the callback's events, disarmed by :meth:`disarm` after the engine's close
    (which captures first while an exception unwinds)."""

    def __init__(self, trainer: Any, ckpt: EngineCheckpointer, export: dict[str, Any] | None,
                 deepspeed_dir: Callable[[], str]) -> None:
        self._trainer, self._deepspeed_dir = trainer, deepspeed_dir
        self._rng: dict[str, Any] | None = None
        self._step_wrapper: Any = None
        self._capture: FailureCapture | None = None
        deepspeed = getattr(trainer, "is_deepspeed_enabled", False)
        self._deepspeed = deepspeed
        if deepspeed and _deepspeed.zero3(trainer) and not _deepspeed.saves_tag(trainer):
            log.warning("FlashCheckpointCallback(save_on_failure=True) does not capture under ZeRO-3 with "
                        "save_only_model and stage3_gather_16bit_weights_on_model_save: that save is the gathered "
                        "weights alone, a collective across ranks; a failure resumes from the last save")
            return
        # under ZeRO-3 a capture has no model weights (a save may have gathered them)
        may_lack = ("/hf/model",) if deepspeed and _deepspeed.zero3(trainer) else ()
        buffers = ModuleBuffers(trainer.model, trainer.optimizer)
        capture = self._capture = ckpt.capture_with(ckpt.engine_capture(self._tree, export=export,
                                                                        may_lack=may_lack, buffers=buffers))
        if deepspeed:
            from ..deepspeed._engine import step_boundary
            self._step_wrapper = step_boundary(trainer.model_wrapped, capture, counts=False)

    def update_begins(self) -> None:
        """``on_pre_optimizer_step``: waits while a capture copies."""
        if self._capture is not None:
            self._capture.update_begins()

    def step_end(self, step: int) -> None:
        """``on_step_end``: the state is that of ``step``."""
        if self._capture is not None:
            self._rng = capture_rank_state(self._trainer)
            self._capture.update_ends(step)

    def disarm(self) -> None:
        """DeepSpeed's ``engine.step`` as it was (the engine's close disarms the rest)."""
        self._capture = None
        if self._step_wrapper is not None:
            from ..deepspeed._engine import unwrap_step
            unwrap_step(self._trainer.model_wrapped, self._step_wrapper)
            self._step_wrapper = None

    def _tree(self) -> dict[str, Any]:
        """What the callback's save writes, as of the last ``on_step_end``, without its
        bookkeeping (a capture must not change the Trainer's state)."""
        trainer = self._trainer
        tree = dict(self._rng) if self._rng is not None else capture_rank_state(trainer)
        model_state: tuple[Any, bool] = (None, False)
        if self._deepspeed:  # no collective in these: a peer may be dead
            if _deepspeed.saves_tag(trainer):
                from ..deepspeed._engine import local_only
                with local_only(trainer.model_wrapped):
                    tree["deepspeed"] = _deepspeed.capture_files(trainer, self._deepspeed_dir())
            model_state = _deepspeed.model_state_dict(trainer, local=True)
        if trainer.args.process_index == 0:
            tree["hf"] = capture_main_state(trainer, *model_state)
        return tree
