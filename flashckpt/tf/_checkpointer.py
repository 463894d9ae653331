"""Flash checkpoints of a ``tf.train.Checkpoint`` (or a Keras model and its optimizer)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from .._base import EngineCheckpointer
from .._errors import CheckpointError, StateMismatchError
from .._options import Options, resolve_options
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

    ``options``: a :class:`flashckpt.Options` (``persist_every``, ``keep_last``, ``job_id``,
    ``allow_pickle``, ``memory_slots``, ``replicas``); any of its fields may also be given
    as a keyword, laid over ``options``; another keyword is a TypeError. ``memory_slots=1``
    keeps one shared-memory copy instead of two (half the memory; a save then waits
    while storage reads the copy).

    ``background=True``: ``save`` takes the variables' current buffers (reads, no copy)
    and returns; a thread copies them into shared memory while training goes on. TF
    keeps the taken buffers intact (a variable updated meanwhile is copied on write,
    a copy the training step pays for variables the thread has not reached yet). The
    data positions commit once that copy is done; every other call waits for it first.
    It pays off when a training step outlasts the copy; when the next step updates every
    variable at once (one optimizer step over all of them), it pays the copy-on-write
    plus a busy core instead, often more than the blocking copy (``benchmarks/tf_save.py``
    measures both, and TF's own async write, which defers the same way).

    One checkpointer per worker process and directory (workers of a job use their own
    directories). Also a context manager: leaving it calls :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike, checkpoint: Any, *, data: Any = None, rollback: Any = None,
                 background: bool = False, options: Options | None = None, **shorthands: Any) -> None:
        resolved = resolve_options(options, **shorthands)
        self._background = background
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self._root = _variables.as_checkpoint(checkpoint)
        self._positions = positions_of(data)
        self._rollback = rollback  # None: the positions' default (``Rollback.WORKER``)
        self._engine = new_engine(directory, resolved)
        self.extra: Any = None
        """What ``extra`` held at the step the last ``load`` restored (None before)."""

    def save(self, step: int, *, persist: bool | None = None, export: bool = False, extra: Any = None) -> None:
        """Copy every variable into shared memory (the only blocking work; with
        ``background=True`` done by a thread); persist it if due (or if ``persist``).
        ``export``: once committed, the saver also writes a stock TF checkpoint at
        ``<directory>/step-<N>/tf/ckpt`` (in the bucket when ``directory`` is a URL). ``extra``: plain values (int, float, str, bool,
        None, dict, list, tuple, numpy arrays; other objects pickled with ``allow_pickle``)
        saved with the step, in :attr:`extra` after a load of it."""
        self._join()
        variables, graph = _variables.collect(self._root)
        state = {"variables": {key: _variables.read_alias(var) for key, var in variables.items()},
                 "tf": {"format": FORMAT, "object_graph": graph,
                        "bfloat16": _variables.bfloat16_keys({key: var.dtype for key, var in variables.items()}),
                        "extra": extra},
                 "data": data_state(self._positions, self._rollback)}
        mark = self._positions.mark() if self._positions is not None else None
        export_to = {"name": "tf", "params": {}} if export else None
        if not self._background:
            self._save_state(step, [state], persist, export_to, mark)
            return
        self._pending = threading.Thread(target=self._save_state, args=(step, [state], persist, export_to, mark),
                                         name=f"flashckpt-tf-save-{step}")
        del state
        self._pending.start()

    def _save_state(self, step: int, holder: list[dict[str, Any]], persist: bool | None,
                    export: dict[str, Any] | None, mark: Any) -> None:
        try:
            self._engine.save(step, holder[0], persist=persist, export=export)
            holder.clear()  # views of the variables' buffers must not outlive the save (copy-on-write)
            if mark is not None:
                self._positions.commit(mark)
        except BaseException as exc:
            holder.clear()
            if not self._background:
                raise
            self._pending_error = exc

    def _join(self) -> None:
        """Wait for a background save; raise what it failed with."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    def wait(self, timeout: float | None = None) -> None:
        self._join()
        super().wait(timeout)

    def flush(self, timeout: float | None = None) -> None:
        self._join()
        super().flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        try:
            self._join()
        finally:
            super().close(timeout)

    def save_on_failure(self, state_fn: Any, *, optimizer: Any) -> Any:
        """Not supported for TF: always raises :class:`~flashckpt.CheckpointError`.

        Failure capture needs a step boundary seen from Python: whether the variables are
        those of a finished step or half updated. A Keras optimizer has no step hooks, and
        ``apply_gradients`` runs inside the ``tf.function`` of the training step, whose
        ops update the variables from TF's own threads, where no Python code runs; a
        capture from a signal handler could copy a step half applied. Save often instead
        (``save`` costs one copy into memory; ``background=True`` overlaps it)."""
        raise CheckpointError("save_on_failure is not supported by flashckpt.tf.Checkpointer: TF gives no step "
                              "boundary to capture at (a Keras optimizer has no step hooks, and apply_gradients "
                              "updates the variables inside the training step's tf.function, on TF's own threads), "
                              "so a capture could copy a half-applied step; save every few steps instead")

    def load(self, *, step: int | None = None, timeout: float | None = None) -> int | None:
        """Restore the variables (and data positions) of ``step`` (default: the newest in
        memory or on storage) in place; returns the step, or None when there is none.
        ``extra`` of that step is then in :attr:`extra`.

        Keras optimizers that have not taken a step yet get their slots created first (a
        model's compiled optimizer, or one beside a single model; beside several models,
        call ``optimizer.build(variables)`` for each first); a model must be built.
        Mismatched variables raise ``StateMismatchError`` naming them. ``timeout``: as
        :meth:`flashckpt.torch.Checkpointer.load` (a load from memory never waits for the saver).
        """
        self._join()
        fresh = _variables.build_optimizers(self._root)
        variables, _ = _variables.collect(self._root)
        targets: dict[str, np.ndarray] = {}
        assigns: list[tuple[Any, np.ndarray]] = []
        aliases = _variables.without_shared_bytes({key: _variables.writable_alias(var) for key, var in variables.items()})
        for key, var in variables.items():
            alias = aliases[key]
            if alias is None:
                alias = _variables.host_array(var)
                assigns.append((var, alias))
            targets[key] = alias
        state: dict[str, Any] = {"variables": targets, "tf": {}, "data": None}
        try:
            loaded = self._engine.load(state, step=step, timeout=timeout)
        except StateMismatchError as exc:
            if not fresh:
                raise
            raise StateMismatchError(
                f"{exc}\n(the optimizer(s) {', '.join(fresh)} had not taken a step: their variables were made for "
                "this load from the one model's trainable variables or, beside several models, not at all; call "
                "optimizer.build(<the variables it trains>) for each before load())") from exc
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
        self.extra = state["tf"].get("extra")
        return loaded

    def export(self, path: str | os.PathLike, *, step: int | None = None) -> str:
        """Write committed ``step`` (default: the newest, after flushing memory) as a stock
        TF checkpoint with prefix ``path`` (a local path: TF writes the files itself),
        which ``tf.train.Checkpoint.restore(path)`` reads without flashckpt. Returns the prefix."""
        self._join()
        if step is None:
            self._engine.flush()
            step = self._engine.latest_step()
            if step is None:
                raise CheckpointError(f"nothing to export: no checkpoint in {self.directory}")
        return _export.write_tf_checkpoint(self.directory, step, os.fspath(path))
