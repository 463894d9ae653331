"""``FlashCheckpointHook``: flash checkpoints for ``tf.estimator`` (graph mode).

One copy on save: fetching variables with ``Session.run`` would copy each value into a
fresh numpy array (TF copies a buffer the variable still shares), and ours into shared
memory would be the second. Instead the save is an op of the graph, a
``tf.numpy_function`` over the variables' reads, whose numpy inputs are views of the
variables' buffers; it copies them into shared memory from inside ``Session.run``.
Loads are one copy too: a second such op receives views of the variables' buffers and
the engine copies the checkpoint straight into them. That needs the reads to alias the
buffers, which a first op checks (two reads, the first kept alive, at the same address);
a variable whose reads are copies (TF's copy-on-read mode after sparse access) is loaded
into a host array and fed to its assign op instead.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
import tensorflow as tf

from .._errors import CheckpointError
from .._options import Options, resolve_options
from . import _variables
from ._common import FORMAT, data_state, new_engine, positions_of, restore_data
from ._data import graph_positions

__all__ = ["FlashCheckpointHook"]

log = logging.getLogger("flashckpt.tf")


class FlashCheckpointHook(tf.estimator.SessionRunHook):
    """A ``SessionRunHook`` that restores the newest flash checkpoint when the session is
    created and flash-saves every ``every_steps`` global steps and at the end of each
    ``train`` call (then flushed to storage). Call :meth:`close` after the last ``train``.

    Use it instead of the estimator's ``CheckpointSaverHook`` (``RunConfig(
    save_checkpoints_steps=None, save_checkpoints_secs=None)``); one directory per
    worker. The state is every global variable, keyed by name, and — when the training
    graph reads an ``elastic.tf.make_input_fn`` (or ``data`` is given) — the data
    positions: the hook then counts consumed records itself and commits them to the
    coordinator at each save, so model and data roll back together. ``export``: at
    the end, also write a TF checkpoint (``<directory>/step-<N>/tf/ckpt``) that
    estimators and ``tf.compat.v1.train.Saver`` restore. ``options`` (a
    :class:`flashckpt.Options`) and its keyword shorthands go to the engine, as for
    :class:`flashckpt.tf.Checkpointer`.
    """

    def __init__(self, directory: str | os.PathLike, *, every_steps: int = 100, data: Any = None,
                 rollback: Any = None, restore: bool = True, export: bool = False, options: Options | None = None,
                 **shorthands: Any) -> None:
        self._options = resolve_options(options, **shorthands)
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be an int >= 1, got {every_steps!r}")
        self._directory = os.fspath(directory)
        self._every = every_steps
        self._data = data
        self._rollback = rollback
        self._restore = restore
        self._export = export
        self._engine: Any = None
        self.restored_step: int | None = None
        self.last_saved: int | None = None

    def begin(self) -> None:
        self._global_step = tf.compat.v1.train.get_global_step()
        if self._global_step is None:
            raise CheckpointError("FlashCheckpointHook needs a global step in the graph")
        self._variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
        self._bfloat16 = _variables.bfloat16_keys({name: v.dtype for name, v in self._variables.items()})
        self._feeds = {name: tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape, name=f"flashckpt_load_{i}")
                       for i, (name, v) in enumerate(self._variables.items())}
        self._assigns = {name: v.assign(self._feeds[name], read_value=False) for name, v in self._variables.items()}
        self._step_feed = tf.compat.v1.placeholder(tf.int64, [], name="flashckpt_save_step")
        reads = [v.value() for v in self._variables.values()]
        self._save_op = tf.numpy_function(self._save_arrays, [self._step_feed] + reads, tf.int64, stateful=True,
                                          name="flashckpt_save")
        self._probe_op = tf.numpy_function(self._probe_arrays, reads, tf.int64, stateful=True, name="flashckpt_probe")
        self._load_op = tf.numpy_function(self._load_arrays, reads, tf.int64, stateful=True, name="flashckpt_load")
        self._error: BaseException | None = None
        self._probed: list[np.ndarray] = []
        self._loaded: tuple[int | None, dict[str, Any], dict[str, np.ndarray]] | None = None  # of the load op
        self._positions = positions_of(self._data if self._data is not None else graph_positions())
        self._reporter = None
        if self._positions is not None:
            self._reporter = self._positions.report_hook()
            self._reporter.begin()
        if self._engine is None:
            self._engine = new_engine(self._directory, self._options)

    def after_create_session(self, session: Any, coord: Any) -> None:
        self._step = int(session.run(self._global_step))
        if self._restore:
            self.restored_step = self._load(session)
            if self.restored_step is not None:
                self._step = int(session.run(self._global_step))
        self.last_saved = self._step if self.restored_step is not None else None
        self._next = (self._step // self._every + 1) * self._every

    def before_run(self, run_context: Any) -> Any:
        return tf.estimator.SessionRunArgs(self._global_step)

    def after_run(self, run_context: Any, run_values: Any) -> None:
        if self._reporter is not None:
            self._reporter.after_run(run_context, run_values)
        if int(run_values.results) + 1 >= self._next:  # the fetched step may predate the increment
            self._step = int(run_context.session.run(self._global_step))
            if self._step >= self._next:
                self._save(run_context.session, self._step)

    def end(self, session: Any) -> None:
        step = int(session.run(self._global_step))
        if step != self.last_saved:
            self._save(session, step)
        if self._reporter is not None:
            self._reporter.end(session)
        self._engine.flush()
        if self._export and self.last_saved is not None:
            self._export_step(self.last_saved)

    def _export_step(self, step: int) -> None:
        """Write the stock checkpoint outside the estimator's graph: on a fresh thread,
        whose default context is eager (``SaveV2`` must run, not join the graph)."""
        from ._export import write_tf_checkpoint

        errors: list[BaseException] = []

        def run() -> None:
            try:
                write_tf_checkpoint(self._directory, step, os.path.join(self._directory, f"step-{step}", "tf", "ckpt"))
            except BaseException as exc:  # re-raised on the caller's thread
                errors.append(exc)

        thread = threading.Thread(target=run, name="flashckpt-tf-export")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Free this worker's shared memory (after the last ``train`` call); the newest
        step is on storage already. Later ``train`` calls restore from memory until then."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    # -- save / load ----------------------------------------------------------------
    def _run(self, session: Any, op: Any, feed_dict: dict[Any, Any] | None = None) -> None:
        """Run one of our ``numpy_function`` ops; an error raised inside it comes out as itself."""
        self._error = None
        try:
            session.run(op, feed_dict=feed_dict)
        except tf.errors.OpError:
            if self._error is not None:
                raise self._error from None
            raise

    def _save(self, session: Any, step: int) -> None:
        self._run(session, self._save_op, {self._step_feed: step})
        self.last_saved = step
        self._next = (step // self._every + 1) * self._every
        if self._positions is not None:
            self._positions.commit()

    def _save_arrays(self, step: Any, *arrays: np.ndarray) -> np.int64:
        """Runs inside ``Session.run``: ``arrays`` view the variables' buffers."""
        try:
            values = {name: _variables.as_stored(array) for name, array in zip(self._variables, arrays)}
            state = {"variables": values, "tf": {"format": FORMAT, "object_graph": None, "bfloat16": self._bfloat16},
                     "data": data_state(self._positions, self._rollback)}
            self._engine.save(int(step), state)
            return np.int64(step)
        except BaseException as exc:
            self._error = exc
            raise

    def _probe_arrays(self, *arrays: np.ndarray) -> np.int64:
        self._probed = list(arrays)  # kept alive: a copying read cannot reuse their memory
        return np.int64(0)

    def _load_arrays(self, *arrays: np.ndarray) -> np.int64:
        """Runs inside ``Session.run``: loads into the variables' buffers where ``arrays``
        are views of them, else into host arrays (to be assigned)."""
        try:
            probed, self._probed = self._probed, []
            views = _variables.without_shared_bytes({name: _in_place_view(array, before)
                                                     for name, array, before in zip(self._variables, arrays, probed)})
            targets: dict[str, np.ndarray] = {}
            copies: dict[str, np.ndarray] = {}
            for name, var in self._variables.items():
                if views[name] is not None:
                    targets[name] = views[name]
                else:
                    targets[name] = copies[name] = _variables.host_array(var)
            del probed, arrays, views
            state: dict[str, Any] = {"variables": targets, "tf": {}, "data": None}
            step = self._engine.load(state)
            del targets, state["variables"]  # no view of a variable outlives the op (copy-on-write)
            self._loaded = (step, state, copies)
            return np.int64(0)
        except BaseException as exc:
            self._error = exc
            raise

    def _load(self, session: Any) -> int | None:
        self._run(session, self._probe_op)
        try:
            self._run(session, self._load_op)
        finally:
            self._probed = []
        assert self._loaded is not None
        (step, state, copies), self._loaded = self._loaded, None
        if step is None:
            return None
        if state["tf"].get("format") != FORMAT:
            raise CheckpointError(f"{self._directory} step {step}: not a flashckpt.tf checkpoint")
        _variables.check_bfloat16(state["tf"].get("bfloat16"), {n: v.dtype for n, v in self._variables.items()},
                                  f"{self._directory} step {step}")
        if copies:
            log.debug("loading through assign (reads of these are copies): %s", ", ".join(sorted(copies)))
            session.run([self._assigns[name] for name in copies],
                        feed_dict={self._feeds[name]: value.view(self._variables[name].dtype.base_dtype.as_numpy_dtype)
                                   for name, value in copies.items()})
        restore_data(self._positions, state["data"], step)
        return step


def _in_place_view(array: Any, before: Any) -> np.ndarray | None:
    """``array`` (a variable's read inside the load op) as the view a load writes into, when
    it is the variable's own buffer: the same address as the probe's read, writable and
    contiguous; else None (TF handed out a copy)."""
    if (isinstance(array, np.ndarray) and isinstance(before, np.ndarray) and array.nbytes
            and array.ctypes.data == before.ctypes.data and array.flags.writeable and array.flags.c_contiguous):
        return _variables.as_stored(array)
    return None
