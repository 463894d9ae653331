"""What every framework's checkpointer shares: the engine's storage-side calls."""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

from ._boundary import ModuleBuffers
from ._capture import FailureCapture
from ._engine import Engine, LoadInfo
from ._errors import CheckpointError
from ._failure_hooks import FailureHooks

__all__ = ["EngineCheckpointer"]


class EngineCheckpointer:
    """Base of the framework checkpointers: subclasses set ``self._engine`` and add
    their own ``save``/``load``."""

    _engine: Engine
    _captures_failures = False
    """Subclasses whose ``save`` hands the engine the caller's tree as it is set this, so
    that ``state_fn`` of :meth:`save_on_failure` gives what ``save`` would."""
    _capture: FailureCapture | None = None
    _hooks: FailureHooks | None = None

    @property
    def engine(self) -> Engine:
        """The engine underneath, for adapters built on this checkpointer."""
        return self._engine

    @property
    def directory(self) -> str:
        return self._engine.storage.root

    @property
    def job_id(self) -> str:
        """Names this job's shared memory on the node (see ``flashckpt gc``)."""
        return self._engine.job_id

    @property
    def last_load(self) -> LoadInfo | None:
        """Step, source ("memory" / "storage" / None) and seconds of the last load."""
        return self._engine.last_load

    def wait(self, timeout: float | None = None) -> None:
        """Block until every persist asked for so far is durable (raises what failed; node-local
        directories: see :meth:`flashckpt._engine.Engine.wait`)."""
        self._engine.wait(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Persist the newest in-memory step now if it is not on storage yet, and wait."""
        self._engine.flush(timeout)

    def latest_step(self) -> int | None:
        """The newest step committed on storage, now: a load from memory does not wait for
        the saver to write out the previous run's slots (``wait()`` does), and a step of an
        abandoned line stays the newest until this line commits one."""
        return self._engine.latest_step()

    def save_on_failure(self, state_fn: Callable[[], Any], *, optimizer: Any,
                        boundary_state: Callable[[], Any] | None = None,
                        steps_per_update: int = 1) -> FailureCapture:
        """On a failure, save the last finished optimizer step: call once, from the main
        thread, after ``load`` (see ``flashckpt._capture``).

        ``state_fn()`` returns the tree ``save`` takes (checked at the next save: a clear
        error there, not at the failure). The optimizer's step hooks give the boundary:
        the step is the last saved (or loaded) one plus the updates finished since, times
        ``steps_per_update``: save steps per optimizer update, for gradient accumulation
        where ``save``'s step counts micro-batches (``optimizer.step()`` every N of them:
        ``steps_per_update=N``; a failure inside an accumulation captures its last update,
        numbered in micro-batches). Saves must then come at update boundaries; one that
        does not fit the count is warned about, and a capture writes nothing until a save
        fits it again (``flashckpt._capture``). An int >= 1, else a TypeError/ValueError. On
        SIGTERM or SIGINT (also while the main thread is blocked in a C call), an uncaught
        exception, or ``capture()`` of the returned object (the agent's hang verdict), a
        process not inside an update writes ``state_fn()`` as that step into its memory
        slot and has it persisted, once; the signal or exception then goes on as before.
        Replicated state (``DdpCheckpointer``): the first local rank to capture writes the
        node's copy, which serves every rank (local rank 0 killed, a survivor captures);
        per-rank or sharded state loads a capture only where every rank captured it.

        The main thread may have gone on into the next step when another thread captures.
        What changes outside the update is written as of the step's end: the tensors of
        ``state_fn()``'s tree that the optimizer does not own (module buffers such as
        BatchNorm's statistics), and ``boundary_state()``, called at the end of every update,
        on that thread: a partial tree of ``state_fn()``'s (dicts merge, anything else
        replaces) of small state that changes outside the update, e.g. ``{"sampler":
        sampler.state_dict(), "rng": flashckpt.rng_state()}``; cheap (it runs every step), no
        collective; checked at the next save with ``state_fn``.
        """
        if not self._captures_failures:
            raise CheckpointError(f"{type(self).__name__} has no failure capture yet (the torch Checkpointer, "
                                  "DdpCheckpointer, FsdpCheckpointer, DeepSpeedCheckpointer and "
                                  "MegatronCheckpointer have)")
        self._check_no_capture()  # before the optimizer's hooks are registered
        return self.capture_with(self.engine_capture(state_fn, optimizer, boundary_state=boundary_state,
                                                     steps_per_update=steps_per_update))

    def engine_capture(self, state_fn: Callable[[], Any], optimizer: Any = None, *,
                       export: dict[str, Any] | None = None,
                       tree: Callable[[Any], Any] | None = None,
                       may_lack: tuple[str, ...] = (),
                       boundary_state: Callable[[], Any] | None = None,
                       buffers: ModuleBuffers | None = None, owner: Any = None,
                       steps_per_update: int = 1) -> FailureCapture:
        """A capture whose saves go through this checkpointer's engine (persisted, marked
        captured, exported by ``export``), not yet armed (:meth:`capture_with`); None as
        ``optimizer``: the caller gives the step boundary. ``tree(state)``: the tree the
        engine saves, made from what ``state_fn`` returned (default: that itself).
        ``may_lack``, ``boundary_state``, ``buffers``, ``owner``, ``steps_per_update``: see
        :class:`FailureCapture`."""
        engine = self._engine

        def save(step: int, state: Any) -> bool:
            return engine.save(step, state, persist=True, export=export, captured=True) is not None

        return FailureCapture(
            state_fn, optimizer, save=save,
            last_load=lambda: engine.last_load, allow_pickle=engine.options.allow_pickle,
            settle=engine.finish_copy, may_lack=may_lack, boundary_state=boundary_state, tree=tree, buffers=buffers,
            owner=owner, steps_per_update=steps_per_update)

    def _check_no_capture(self) -> None:
        if self._capture is not None:
            raise RuntimeError("save_on_failure() was called already on this checkpointer")

    def capture_with(self, capture: FailureCapture, *, guard_saves: bool = True) -> FailureCapture:
        """Arm ``capture``, built by an adapter with its own step boundary and save (the
        Trainer callback, the DeepSpeed checkpointer): the failure hooks call it, and
        :meth:`close` (also while an exception unwinds) captures and disarms it. Main
        thread, once. ``guard_saves``: every save of the engine goes through
        ``capture.saving``; False where the adapter wraps its own saves in it instead."""
        self._check_no_capture()
        hooks = FailureHooks(capture.capture, capture.busy_here)
        capture.on_idle = hooks.run_deferred
        if guard_saves:
            self._engine.save_guard = capture.saving
        hooks.install()
        self._capture, self._hooks = capture, hooks
        return capture

    def _loading(self) -> AbstractContextManager[Any]:
        """Around a load into the live state: an armed capture writes nothing meanwhile."""
        return self._capture.loading() if self._capture is not None else nullcontext()

    def capture_failure(self, reason: str = "capture_failure()") -> int | None:
        """Capture the last finished step now, as on a failure (an agent's hang or failure
        verdict, from any thread); the step written, or None (no :meth:`save_on_failure`,
        or nothing to capture: see ``FailureCapture.capture``)."""
        capture = self._capture
        return capture.capture(reason) if capture is not None else None

    def close(self, timeout: float | None = None) -> None:
        """Persist the newest step if needed, wait for storage, free shared memory
        (while an exception unwinds, after a failure capture: see :meth:`save_on_failure`).

        Waits for storage at most ``timeout`` seconds (default ``FLASHCKPT_SAVER_TIMEOUT``);
        past it :class:`~flashckpt.CheckpointTimeoutError` naming the step, its memory copy kept."""
        capture, hooks = self._capture, self._hooks
        unwinding = sys.exc_info()[0]
        if capture is not None and unwinding is not None and not issubclass(unwinding, SystemExit):
            capture.capture(f"{unwinding.__name__} at close")
        if capture is not None and hooks is not None:
            self._capture = self._hooks = None
            self._engine.save_guard = None
            capture.close()
            hooks.uninstall()
        self._engine.close(timeout=timeout)

    def __enter__(self) -> "EngineCheckpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None and not issubclass(exc[0], SystemExit) and self._capture is not None:
            # before close, which flushes the newest step
            self._capture.capture(f"{exc[0].__name__} leaving the checkpointer's with block")
        self.close()
