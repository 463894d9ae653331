"""Failure capture: at a failure, save the last finished optimizer step (issue 42).

Parameters and optimizer state change only inside ``optimizer.step()``. The optimizer's
step pre- and post-hooks tell whether an update is in progress and count the updates
finished since the last save (or load): the current step is ``k = last saved step +
updates since * steps_per_update`` (1, or N where the loop accumulates gradients over N
micro-batches and numbers its saves in micro-batches). At a failure
(:mod:`flashckpt._failure_hooks` calls :meth:`FailureCapture.capture`
on a signal, an uncaught exception, or the agent's verdict) a process with no update in
progress writes ``state_fn()`` as step k into its slot through the engine's ordinary save
(``captured=True``, persisted), from whichever thread comes first; one caught inside an
update writes nothing and says so. While a capture copies, the optimizer's pre-hook and
any save wait, so the parameters never change under the copy. At most one capture per
process: a second failure, even during the capture, adds nothing. Adapters whose update is
not one torch ``optimizer.step()`` give the boundary themselves (:meth:`FailureCapture.update_begins`,
:meth:`FailureCapture.update_ends`): the Trainer callback from ``on_pre_optimizer_step`` to
``on_step_end``, the DeepSpeed checkpointer around ``engine.step``, the megatron checkpointer
from the optimizer wrapper's ``step_with_ready_grads`` to the end of its ``step``.

The main thread may have gone on into the next step when another thread captures (drawn
its batch, used the RNGs, run forward): what changes outside the update is kept as of each
boundary (:mod:`flashckpt._boundary`: ``boundary_state``'s values, the tensors outside the
optimizer) and written in place of the live values.

Gradient accumulation: with ``steps_per_update=N`` a capture inside an accumulation writes
the last update, numbered as the loop numbers it (a multiple of N past the last save). The
count is checked at each save: one ``U > 0`` updates after a saved or loaded step ``B`` must
be step ``B + U * N``. One that is not (N wrong, a save in the middle of an accumulation, a
step whose ``optimizer.step()`` a ``GradScaler`` skipped) is warned about once, and until a
later save agrees with the count from the save before it a capture writes nothing (its
number would be wrong: a restart resumes from the newest save instead).

Trade-offs, plainly: saves must come at update boundaries (after ``optimizer.step()``,
before the next micro-batch): a save in the middle of an accumulation holds none of its
gradients, and where such saves keep one offset the check cannot see it, so it goes into
the captured numbers; a capture before a run's first save rests on ``steps_per_update``
alone (a fresh start's first save is not checked either: no saved or loaded step to count
from); a data-loader or RNG position not in ``boundary_state`` is written as it is at the
failure (possibly a step ahead).
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ._boundary import BoundarySnapshot, ModuleBuffers
from ._errors import CheckpointError, StateMismatchError
from ._step_hooks import check_optimizer, hook_steps
from .memory._tree import flatten

__all__ = ["FailureCapture", "capturing", "check_steps_per_update", "on_update_begins"]

log = logging.getLogger("flashckpt")

_this_thread = threading.local()


def capturing() -> bool:
    """Whether this thread is inside a failure capture's call of ``state_fn``: state that a
    save reads from shared services (``elastic.ShardSampler``) then takes what its last
    step boundary kept, with no collective (a peer may be dead)."""
    return getattr(_this_thread, "capturing", False)


_at_update_begins: list[weakref.WeakMethod] = []


def on_update_begins(method: Callable[[], None]) -> None:
    """Call ``method`` (a bound method, held weakly) on the training thread as each optimizer
    update of this process begins (after any capture): state kept in shared services
    (``elastic.ShardSampler``'s positions at the coordinator) is then that of the step the
    update ends, also where the process dies inside the update."""
    _at_update_begins[:] = [ref for ref in _at_update_begins if ref() is not None]
    if not any(ref() == method for ref in _at_update_begins):
        _at_update_begins.append(weakref.WeakMethod(method))


def check_steps_per_update(steps_per_update: Any) -> int:
    """``steps_per_update`` if it is an int >= 1, else a TypeError or ValueError saying so."""
    if isinstance(steps_per_update, bool) or not isinstance(steps_per_update, numbers.Integral):
        raise TypeError("steps_per_update must be an int (save steps per optimizer update), got "
                        f"{type(steps_per_update).__name__} {steps_per_update!r}")
    if steps_per_update < 1:
        raise ValueError(f"steps_per_update must be >= 1 (save steps per optimizer update), got {steps_per_update}")
    return int(steps_per_update)


WAIT_SECONDS = 120.0
"""How long a capture waits for a save in flight on another thread (and another
thread's capture waits for this one) before it gives up."""


class FailureCapture:
    """The step boundary of one optimizer and the one capture of this process.

    ``save(step, state)`` writes a captured step (the engine's save with ``captured=True``,
    persisted), returning False where the memory it writes holds that step already (a
    replicated state's node copy, which any local rank may capture: the first one's
    serves); ``last_load()`` is the engine's ``last_load`` (a load restarts the count from
    the loaded step). ``may_lack``: subtrees (paths such as ``/hf/model``) that the
    check of ``state_fn`` against a save leaves out, where a capture writes less than a
    save by design (the Trainer's ZeRO-3 weights, which only a gather across ranks gives).
    ``boundary_state``: a partial tree of ``state_fn``'s, taken at each step boundary and
    written in place of the live values (see :mod:`flashckpt._boundary`). ``tree(state)``:
    the tree ``save`` gets, made from ``state_fn()``'s with those values (default: that itself).
    ``buffers``: the module and optimizer whose buffers are kept at each boundary, where the
    adapter's save writes the module (the Trainer's, DeepSpeed's); else they are looked for
    in the tree (see :mod:`flashckpt._boundary`), leaving out what ``optimizer`` owns, or
    ``owner`` where the adapter gives the boundary: what its update owns, shaped as a torch
    optimizer's ``param_groups`` and ``state`` (megatron's wrappers). ``steps_per_update``:
    save steps per optimizer update (gradient accumulation where ``save``'s step counts
    micro-batches); a capture is numbered ``last save + updates * steps_per_update``.
    """

    def __init__(self, state_fn: Callable[[], Any], optimizer: Any, *, save: Callable[[int, Any], Any],
                 last_load: Callable[[], Any], allow_pickle: bool = False,
                 settle: Callable[[], None] = lambda: None, may_lack: tuple[str, ...] = (),
                 boundary_state: Callable[[], Any] | None = None, tree: Callable[[Any], Any] | None = None,
                 buffers: ModuleBuffers | None = None, owner: Any = None, steps_per_update: int = 1) -> None:
        self._per = check_steps_per_update(steps_per_update)
        if not callable(state_fn):
            raise TypeError(f"state_fn must be callable (returning the tree save takes), got {type(state_fn).__name__}")
        if optimizer is not None:
            check_optimizer(optimizer)
        self._boundary = BoundarySnapshot(state_fn, boundary_state, optimizer if optimizer is not None else owner,
                                          tree, buffers=buffers)
        self._state_fn, self._save, self._last_load = state_fn, save, last_load
        self._allow_pickle = allow_pickle
        self._may_lack = may_lack
        self._settle = settle
        """Waits for a save still copying (an overlapped save): a capture comes after it."""
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._updating: str | None = None
        """What is changing the state now ("an optimizer update", "a load"), else None."""
        self._seen_load = last_load()
        loaded = self._seen_load
        self._base = loaded.step if loaded is not None and loaded.step is not None else 0
        """The last saved (or loaded) step; 0 for a run that neither loaded nor saved yet."""
        self._known = loaded is not None and loaded.step is not None
        """``_base`` came from a save or load of this run (not a fresh start's 0): saves are checked against it."""
        self._contradicted: str | None = None
        """The save that did not fit the count, while none since has (a capture then writes nothing)."""
        self._warned = False
        self._saved = False
        """``_base`` is a step this process saved (which wrote nothing where it keeps no copy
        of replicated state: the capture writes it then, unless the node holds it)."""
        self._steps = 0
        """Optimizer updates finished since ``_base`` (each ``steps_per_update`` steps)."""
        self._checked = False
        self._saving: int | None = None  # the thread inside a save
        self._capturing: int | None = None  # the thread inside the capture
        self._decided = False
        self._captured: int | None = None
        self._closed = False
        self.on_idle: Callable[[], None] = lambda: None
        """Called on a thread that ends a save or the capture (signals deferred meanwhile)."""
        self._handles = [] if optimizer is None else hook_steps(optimizer, self.update_begins, self.update_ends)
        """None as ``optimizer``: the adapter gives the boundary (:meth:`update_begins`, :meth:`update_ends`)."""

    # -- the step boundary -------------------------------------------------------

    def _sync_load(self) -> None:
        """A load since the last save restarts the count from the loaded step (caller holds the lock)."""
        loaded = self._last_load()
        if loaded is not self._seen_load:
            self._seen_load = loaded
            self._base, self._steps = (loaded.step or 0) if loaded is not None else 0, 0
            self._known, self._contradicted = loaded is not None and loaded.step is not None, None
            self._saved = False
            self._boundary.forget()

    def update_begins(self) -> None:
        """The state starts to change (the optimizer's step pre-hook, or an adapter's own
        boundary: the Trainer's ``on_pre_optimizer_step``, DeepSpeed's ``engine.step``);
        waits while a capture copies, then calls the :func:`on_update_begins` methods (one that
        raises fails the update before it changed anything: the step stays capturable)."""
        with self._cond:
            self._wait_for(lambda: self._capturing is None or self._capturing == threading.get_ident(), "the capture")
            self._sync_load()
            self._updating = "an optimizer update"
        try:
            for ref in list(_at_update_begins):
                if (method := ref()) is not None:
                    method()
        except BaseException:  # raised before the update: the state is still the last step's
            with self._cond:
                self._updating = None
            raise

    def update_ends(self, step: int | None = None) -> None:
        """The update is over: the state is that of ``steps_per_update`` steps later, or of
        ``step`` where the adapter knows its number (the Trainer's ``global_step`` at ``on_step_end``);
        one on the thread inside a save is no update (the save's own, as FSDP's ``get_state_dict``
        makes a fresh optimizer's state). An
        update that raised never ends: nothing is captured after it; nor after a
        ``boundary_state`` that raised (raised here)."""
        try:  # while the update still counts as in progress: no capture copies meanwhile
            self._boundary.take()
        except BaseException:
            with self._cond:
                self._updating = "a step boundary whose boundary_state() raised"
            raise
        with self._cond:
            self._updating = None
            if step is None:
                if self._saving != threading.get_ident():  # not a fresh optimizer's state made by a save
                    self._steps += 1  # (FSDP's get_state_dict steps it): the saved step's own, no update
            else:
                self._sync_load()
                self._steps = max(0, step - self._base) // self._per

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Wraps a load into the live state: a capture meanwhile writes nothing (the state is
        part old, part loaded), nor after a load that raised; one that returns makes the
        loaded step the count's base."""
        with self._cond:
            self._wait_for(lambda: self._capturing is None, "the capture")
            self._updating = "a load"
        yield
        with self._cond:
            self._updating = None
            self._sync_load()

    @contextmanager
    def saving(self, step: int, state: Any) -> Iterator[None]:
        """Wraps every save (the engine's ``save_guard``): the first checks ``state_fn``
        against ``state``; a save that returns is checked against the count
        (:meth:`_check_count`) and makes ``step`` the count's base."""
        me = threading.get_ident()
        with self._cond:
            self._wait_for(lambda: self._capturing is None, "the capture")
            self._saving = me
        done, warning = False, None
        try:
            if not self._checked:
                self._check(state)
                self._checked = True
            yield
            done = True
        finally:
            with self._cond:
                self._saving = None
                if done:
                    self._sync_load()
                    warning = self._check_count(step)
                    self._base, self._steps, self._saved, self._known = step, 0, True, True
                self._cond.notify_all()
            if warning:
                log.warning("%s", warning)
            self.on_idle()

    def _check_count(self, step: int) -> str | None:
        """A save ``U > 0`` updates after a saved or loaded step ``B`` must be step ``B + U *
        steps_per_update``: one that is not makes a capture write nothing until a save fits
        the count from the save before it (caller holds the lock). The first misfit's
        warning, or None."""
        if not self._known or self._steps == 0:
            return None
        base, updates, per = self._base, self._steps, self._per
        expected = base + updates * per
        if step == expected:
            self._contradicted = None
            return None
        self._contradicted = (f"save({step}) came {updates} optimizer update(s) after step {base}, where "
                              f"steps_per_update={per} makes it {expected}")
        if self._warned:
            return None
        self._warned = True
        fits = (step - base) // updates if step > base and (step - base) % updates == 0 else None
        return (f"save_on_failure: {self._contradicted}: "
                + (f"{fits} save steps per update would fit (the torch checkpointers' steps_per_update={fits})"
                   if fits else "no number of save steps per update fits")
                + " (or the save is not at an update boundary, or an optimizer.step() was skipped); "
                "a failure captures nothing until a save fits the count again (warned once)")

    def _check(self, state: Any) -> None:
        """``state_fn()`` gives the tree ``save`` takes: its tensors' names, dtypes and
        shapes are those of ``state``; else a clear error now, not at the failure."""
        try:
            mine = self._state_fn()
        except Exception as exc:
            raise CheckpointError(f"save_on_failure: state_fn() raised {type(exc).__name__}: {exc} "
                                  "(it must return the tree save() takes)") from exc
        try:
            got = _signature(mine, self._allow_pickle)
        except CheckpointError as exc:
            raise CheckpointError(f"save_on_failure: state_fn() returned a state save() cannot take: {exc}") from exc
        if self._boundary.boundary_state is not None:
            self._check_boundary(got)
        want = _signature(state, self._allow_pickle)
        if self._may_lack:
            got, want = ({path: what for path, what in tree.items()
                          if not any(path == top or path.startswith(top + "/") for top in self._may_lack)}
                         for tree in (got, want))
        if got != want:
            missing = sorted(set(want) - set(got))
            extra = sorted(set(got) - set(want))
            other = sorted(n for n in set(want) & set(got) if want[n] != got[n])
            parts = [f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                     for label, names in (("missing", missing), ("not saved", extra), ("dtype/shape", other))
                     if names]
            raise StateMismatchError("save_on_failure: state_fn() returns another tree than save() "
                                     f"got ({'; '.join(parts)})")

    def _check_boundary(self, tree: dict[str, Any]) -> None:
        """``boundary_state()`` gives parts of ``state_fn()``'s tree (``tree``: its signature)."""
        try:
            given = _signature(self._boundary.boundary_state(), self._allow_pickle)
        except Exception as exc:
            raise CheckpointError(f"save_on_failure: boundary_state() raised or returned what save() cannot take: "
                                  f"{type(exc).__name__}: {exc}") from exc
        wrong = sorted(path for path, what in given.items() if tree.get(path) != what)
        if wrong:
            raise StateMismatchError("save_on_failure: boundary_state() gives what state_fn()'s tree does not hold "
                                     f"alike ({', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''})")

    # -- the capture -------------------------------------------------------------

    def as_of_boundary(self, tree: Any) -> Any:
        """``tree``, built by the adapter's own save during the capture (DeepSpeed's files),
        with the module's buffers of the last boundary in place of the live ones (the live
        ones left as they are; see ``BoundarySnapshot.swap``)."""
        return self._boundary.swap(tree)

    def busy_here(self) -> bool:
        """This thread is inside a save or the capture (a signal handler must defer)."""
        me = threading.get_ident()
        return self._saving == me or self._capturing == me

    @property
    def current_step(self) -> int:
        """The step of the last finished update (``last saved + updates since * steps_per_update``)."""
        with self._cond:
            self._sync_load()
            return self._base + self._steps * self._per

    def capture(self, reason: str = "capture()") -> int | None:
        """Write the last finished step as a captured save, once per process; returns its
        step (also where another local rank's capture wrote it first), or None when nothing
        was written (an update in progress, no update since the last save or load, closed).
        Any thread may call it; a second call returns the first's answer (waiting for it,
        where another thread captures)."""
        me = threading.get_ident()
        if os.getpid() == self._pid and self._saving != me:
            try:  # the step an overlapped save copies is complete before this process goes on to end
                self._settle()
            except Exception as exc:  # never let a capture turn one failure into another
                log.error("failure (%s): the save still copying failed: %s: %s", reason, type(exc).__name__, exc)
        with self._cond:
            if self._closed or os.getpid() != self._pid or self._capturing == me or self._saving == me:
                return None
            if self._decided:
                self._wait_for(lambda: self._capturing is None, "the capture")
                return self._captured
            self._decided = True
            if not self._wait_for(lambda: self._saving is None, "a save in flight"):
                return None
            self._sync_load()
            step = self._base + self._steps * self._per
            if self._updating:
                log.warning("failure (%s) inside %s (step %d): nothing captured, the state is part old, part new; "
                            "a restart loads the newest save", reason, self._updating, step)
                return None
            if self._steps == 0 and not self._saved:
                _nothing_since(reason, step)
                return None
            if self._contradicted is not None and self._steps > 0:
                log.warning("failure (%s): nothing captured: the last save did not fit the step count (%s), so "
                            "step %d may be misnumbered; a restart loads the newest save", reason, self._contradicted,
                            step)
                return None
            self._capturing = me
        try:
            _this_thread.capturing = True
            try:
                state = self._state_fn()
            finally:
                _this_thread.capturing = False
            written = self._save(step, self._boundary.apply(state)) is not False
            if written:
                self._captured = step
                log.warning("failure (%s): captured step %d into memory (persisting)", reason, step)
            elif self._steps == 0:  # this process's own save of it
                _nothing_since(reason, step)
            else:
                self._captured = step
                log.info("failure (%s): step %d is in this node's memory already", reason, step)
        except BaseException as exc:  # never let a capture turn one failure into another
            log.error("failure (%s): capturing step %d failed: %s: %s", reason, step, type(exc).__name__, exc)
        finally:
            with self._cond:
                self._capturing = None
                self._cond.notify_all()
            self.on_idle()
        return self._captured

    def _wait_for(self, ready: Callable[[], bool], what: str) -> bool:
        """Wait (caller holds the lock) until ``ready()``; False after ``WAIT_SECONDS``."""
        if not self._cond.wait_for(ready, WAIT_SECONDS):
            log.error("waited %.0fs for %s; going on without it", WAIT_SECONDS, what)
            return False
        return True

    def keep(self, handle: Any) -> None:
        """Remove ``handle`` (its ``remove()``) with the optimizer hooks at :meth:`close`: an
        adapter's own step boundary."""
        self._handles.append(handle)

    def close(self) -> None:
        """Remove the optimizer hooks (and what :meth:`keep` holds); later captures do nothing."""
        with self._cond:
            self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._boundary.close()


def _signature(state: Any, allow_pickle: bool) -> dict[str, Any]:
    """Path -> what is there (a tensor's dtype and shape, "value", "pickled", an empty
    container): the structure of a state, whatever its plain values."""
    flat = flatten(state, allow_pickle=allow_pickle)
    tensors = {leaf.name: (leaf.dtype, leaf.shape) for leaf in flat.leaves}
    out: dict[str, Any] = {}

    def walk(node: dict[str, Any], path: str) -> None:
        if "t" in node:
            out[path] = tensors.get(node["t"], "tensor")
        elif "v" in node or "p" in node:
            out[path] = "value" if "v" in node else "pickled"
        elif "d" in node:
            for key, child in node["d"]:
                walk(child, f"{path}/{key}")
            if not node["d"]:
                out[path] = "{}"
        else:
            items = node.get("l", node.get("u", []))
            for i, child in enumerate(items):
                walk(child, f"{path}/{i}")
            if not items:
                out[path] = "[]"

    walk(flat.skeleton, "")
    return out


def _nothing_since(reason: str, step: int) -> None:
    log.info("failure (%s): no optimizer step since step %d, nothing to capture", reason, step)
