"""Flash checkpoints of a ``tf.train.Checkpoint`` (or a Keras model and its optimizer)."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from .._base import EngineCheckpointer
from .._errors import CheckpointError
from . import _export, _variables
from ._common import FORMAT, data_state, new_engine, positions_of, restore_data

__all__ = ["Checkpointer"]

log = logging.getLogger("flashckpt.tf")


class Checkpointer(EngineCheckpointer):
    """Flash checkpoints of the variables of ``checkpoint`` (eager TF 2).

    ``checkpoint``: a ``tf.train.Checkpoint``, a Keras model (saved with its optimizer)
    or a dict of trackables. ``save(step)`` blocks only while the variables' bytes are
    copied into shared memory; a saver process writes
    ``<directory>/step-<N>/rank-0.safetensors`` in the background every
    ``persist_every`` saves. ``load()`` restores the newest step from memory, or from
    storage when memory holds nothing newer. ``data`` (an ``elastic.tf.ShardDataset``)
    puts the data positions into every checkpoint, so model and data roll back together
    (``rollback``: an ``elastic.tf.Rollback``; default ``WORKER``).

    One checkpointer per worker process and directory (workers of a job use their own
    directories). Also a context manager: leaving it calls :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike, checkpoint: Any, *, data: Any = None, rollback: Any = None,
                 persist_every: int = 1, keep_last: int = 3, job_id: str | None = None) -> None:
        self._root = _variables.as_checkpoint(checkpoint)
        self._positions = positions_of(data)
        if rollback is None and self._positions is not None:
            from elastic.tf import Rollback

            rollback = Rollback.WORKER
        self._rollback = rollback
        self._engine = new_engine(directory, persist_every=persist_every, keep_last=keep_last, job_id=job_id)

    def save(self, step: int, *, persist: bool | None = None, export: bool = False) -> None:
        """Copy every variable into shared memory (the only blocking work); persist it if
        due (or if ``persist``). ``export``: once committed, the saver also writes a stock
        TF checkpoint at ``<directory>/step-<N>/tf/ckpt``."""
        variables, graph = _variables.collect(self._root)
        state = {"variables": {key: _variables.read_alias(var) for key, var in variables.items()},
                 "tf": {"format": FORMAT, "object_graph": graph,
                        "bfloat16": _variables.bfloat16_keys({key: var.dtype for key, var in variables.items()})},
                 "data": data_state(self._positions, self._rollback)}
        self._engine.save(step, state, persist=persist, export={"name": "tf", "params": {}} if export else None)
        del state  # views of the variables' buffers must not outlive the save (copy-on-write)
        if self._positions is not None:
            self._positions.commit()

    def load(self, *, step: int | None = None) -> int | None:
        """Restore the variables (and data positions) of ``step`` (default: the newest in
        memory or on storage) in place; returns the step, or None when there is none.

        Keras optimizers that have not taken a step yet get their slots created first;
        a model must be built. Mismatched variables raise ``StateMismatchError`` naming them.
        """
        _variables.build_optimizers(self._root)
        variables, _ = _variables.collect(self._root)
        targets: dict[str, np.ndarray] = {}
        assigns: list[tuple[Any, np.ndarray]] = []
        for key, var in variables.items():
            alias = _variables.writable_alias(var)
            if alias is None:
                alias = _variables.host_array(var)
                assigns.append((var, alias))
            targets[key] = alias
        state: dict[str, Any] = {"variables": targets, "tf": {}, "data": None}
        loaded = self._engine.load(state, step=step)
        if loaded is None:
            return None
        if state["tf"].get("format") != FORMAT:
            raise CheckpointError(f"{self.directory} step {loaded}: not a flashckpt.tf checkpoint "
                                  f"(format {state['tf'].get('format')!r})")
        _variables.check_bfloat16(state["tf"].get("bfloat16"), {key: var.dtype for key, var in variables.items()},
                                  f"{self.directory} step {loaded}")
        for var, value in assigns:
            var.assign(value.view(var.dtype.as_numpy_dtype))
        restore_data(self._positions, state["data"], loaded)
        return loaded

    def export(self, path: str | os.PathLike, *, step: int | None = None) -> str:
        """Write committed ``step`` (default: the newest, after flushing memory) as a stock
        TF checkpoint with prefix ``path``, which ``tf.train.Checkpoint.restore(path)``
        reads without flashckpt. Returns the prefix."""
        if step is None:
            self._engine.flush()
            step = self._engine.latest_step()
            if step is None:
                raise CheckpointError(f"nothing to export: no checkpoint in {self.directory}")
        return _export.write_tf_checkpoint(self.directory, step, os.fspath(path))
