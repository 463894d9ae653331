"""``FlashCheckpointCallback``: flash checkpoints from Keras ``fit``."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import tensorflow as tf

from .._options import Options, resolve_options
from ._checkpointer import Checkpointer

__all__ = ["FlashCheckpointCallback"]

log = logging.getLogger("flashckpt.tf")


class FlashCheckpointCallback(tf.keras.callbacks.Callback):
    """Restore at the start of ``fit`` and flash-save every ``every_steps`` batches.

    The saved state is the model with its optimizer (or ``checkpoint``, a
    ``tf.train.Checkpoint``) and, with ``data`` (the ``elastic.tf.ShardDataset`` the
    model is fit on, read in batches of ``batch_size`` records), the data positions:
    shards complete when their records were trained, and a restore puts model and data
    back together. The step is the number of batches trained (across ``fit`` calls).
    A failed read gives the shard back to the coordinator and raises
    ``elastic.tf.ShardReadError``. ``rollback``, ``background``, ``options`` and the
    options' keyword shorthands go to :class:`Checkpointer` (another keyword is a TypeError here).
    At the end of ``fit`` the newest step is saved and persisted.
    """

    def __init__(self, directory: str | os.PathLike, *, every_steps: int = 100, data: Any = None,
                 batch_size: int | None = None, checkpoint: Any = None, restore: bool = True, rollback: Any = None,
                 background: bool = False, options: Options | None = None, **shorthands: Any) -> None:
        super().__init__()
        resolved = resolve_options(options, **shorthands)
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be an int >= 1, got {every_steps!r}")
        if data is not None and batch_size is None:
            raise ValueError("batch_size= is required with data= (records per trained batch)")
        self._directory = directory
        self._every = every_steps
        self._data = data
        self._batch_size = batch_size
        self._checkpoint = checkpoint
        self._restore = restore
        self._checkpointer_args = {"rollback": rollback, "background": background, "options": resolved}
        self.checkpointer: Checkpointer | None = None
        self.step = 0
        self.restored_step: int | None = None
        self._saved = -1
        self._seen = 0

    def on_train_begin(self, logs: Any = None) -> None:
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self._directory, self._checkpoint or self.model, data=self._data,
                                             **self._checkpointer_args)
            positions = self.checkpointer._positions
            if positions is not None:
                positions.batch_size = self._batch_size
            if self._restore:
                self.restored_step = self.checkpointer.load()
                self.step = self._saved = self.restored_step or 0
        self._wrap_train_function()

    def _wrap_train_function(self) -> None:
        positions = self.checkpointer._positions if self.checkpointer else None
        train = self.model.train_function
        if positions is None or getattr(train, "_flashckpt_wrapped", False):
            return

        @functools.wraps(train)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return train(*args, **kwargs)
            except tf.errors.OutOfRangeError:
                raise
            except tf.errors.OpError as exc:  # the data pipeline failed (a step error also lands here)
                raise positions.fail(exc) from exc

        guarded._flashckpt_wrapped = True  # type: ignore[attr-defined]
        self.model.train_function = guarded

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._seen = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        steps = batch + 1 - self._seen  # more than one with steps_per_execution > 1
        self._seen = batch + 1
        positions = self.checkpointer._positions
        if positions is not None:
            positions.consumed_steps(steps)
        self.step += steps
        if self.step // self._every > self._saved // self._every:
            self._save()

    def _save(self) -> None:
        self.checkpointer.save(self.step)
        self._saved = self.step

    def on_train_end(self, logs: Any = None) -> None:
        if self.checkpointer is None:
            return
        if self._saved != self.step:
            self._save()
        self.checkpointer.flush()

    def close(self) -> None:
        """Flush and free shared memory (call when training is over)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
