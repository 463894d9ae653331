"""Flash checkpointers for torch: every rank's own state, or replicated (DDP) state."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from .._base import EngineCheckpointer
from .._capture import check_steps_per_update
from .._engine import Collective, Engine, SaveHandle, SingleProcess, place
from .._options import Options, resolve_options
from . import _tensors  # noqa: F401  (registers the torch tensor kind)
from ._overlap import StepWaits

__all__ = ["Checkpointer", "DdpCheckpointer", "ProcessGroupCollective", "collective_for"]


class ProcessGroupCollective:
    """Small-object exchange over ``torch.distributed`` (a gloo side group under NCCL)."""

    def __init__(self, group: Any = None) -> None:
        if dist.get_backend(group) != "gloo":
            group = dist.new_group(backend="gloo")  # all ranks construct checkpointers together
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def collective_for(process_group: Any = None) -> Collective:
    """The process group's collective when ``torch.distributed`` is initialised, else one process."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupCollective(process_group)
    return SingleProcess()


class Checkpointer(EngineCheckpointer):
    """Flash checkpoints of a state that every rank holds its own part of.

    ``save(step, state)`` blocks only while the tensors of ``state`` are copied into
    this rank's shared memory; a saver process on the node writes
    ``<directory>/step-<N>/rank-<R>.safetensors`` in the background every
    ``persist_every`` saves, and commits the step once every rank's shard is durable.
    ``load(state)`` fills the tensors of ``state`` in place from the newest step that
    every rank holds in memory, or else from the newest committed step on storage.

    With ``torch.distributed`` initialised, every rank must construct the checkpointer
    and call ``load`` (they agree on one step); ``save`` needs no communication.
    ``replicas`` (default: 1 when the job spans two or more nodes): each node's saver also
    copies the node's newest step into the next node's memory, so that a node lost whole
    restores from a survivor's memory (``load`` counts those copies); 0 turns it off. A
    state is any nesting of dict / list / tuple with tensors and int, float, str, bool
    or None leaves. Also a context manager: leaving it calls :meth:`close`.

    ``options``: a :class:`flashckpt.Options`; any of its fields may also be given as a
    keyword (``persist_every=10``), laid over ``options``; another keyword is a TypeError.
    """

    _replicated = False
    _captures_failures = True

    def __init__(self, directory: str | os.PathLike, *, options: Options | None = None, process_group: Any = None,
                 **shorthands: Any) -> None:
        resolved = resolve_options(options, **shorthands)
        collective = collective_for(process_group)
        self._engine = Engine(os.fspath(directory), resolved, place(collective, replicated=self._replicated),
                              collective, overlaps=True)
        self._step_waits = StepWaits(self._engine.finish_copy)

    def save(self, step: int, state: Any, *, persist: bool | None = None, overlap: bool | None = None,
             optimizer: Any = None) -> SaveHandle:
        """Copy ``state`` into shared memory; persist it if due (or if ``persist``).
        Returns a :class:`~flashckpt.SaveHandle` (``.wait()``, ``.done()``, ``.durable()``,
        ``.wait_copy()``, ``.copied()``).

        ``overlap`` (default: the ``overlap`` option): return before the tensors that
        ``optimizer`` owns (its parameters and state, by storage) are copied; the copy runs
        on the copy threads while the next forward and backward go on, and the optimizer's
        next ``step()`` waits for it. Every other tensor (buffers such as BatchNorm's
        running statistics) is copied before ``save`` returns. The next save, ``load``,
        ``wait``, ``close`` and a failure capture also wait; an error of the copy is raised
        by the first of them (or by ``step()``). ``optimizer`` (one, or a list): hooked once,
        remembered for later saves; the optimizer given to :meth:`save_on_failure` is known
        already. ``overlap`` with no optimizer known is a ValueError.
        """
        if optimizer is not None:
            self._step_waits.add(optimizer)
        if not (self._engine.options.overlap if overlap is None else overlap):
            return self._engine.save(step, state, persist=persist)
        if not self._step_waits:
            raise ValueError("save(overlap=True) needs the optimizer whose step() changes the state, to wait for "
                             "the copy: pass optimizer=... (once), or call save_on_failure(..., optimizer=...) first")
        return self._engine.save(step, state, persist=persist, defer=self._step_waits.deferred())

    def save_on_failure(self, state_fn: Any, *, optimizer: Any, boundary_state: Any = None,
                        steps_per_update: int = 1) -> Any:
        """As :meth:`flashckpt._base.EngineCheckpointer.save_on_failure`; ``optimizer`` is
        also the one overlapped saves wait for (see :meth:`save`). ``steps_per_update``: save
        steps per optimizer update (gradient accumulation where ``save``'s step counts
        micro-batches): a capture is numbered ``last save + updates * steps_per_update``."""
        self._check_no_capture()
        check_steps_per_update(steps_per_update)  # before any hook is registered
        self._step_waits.add(optimizer)  # hooked first: a copy's error raised in step() comes before an update begins
        return super().save_on_failure(state_fn, optimizer=optimizer, boundary_state=boundary_state,
                                       steps_per_update=steps_per_update)

    def close(self, timeout: float | None = None) -> None:
        """As :meth:`flashckpt._base.EngineCheckpointer.close`, after an overlapped save's copy;
        the optimizers' hooks of overlapped saves are removed."""
        try:
            super().close(timeout)
        finally:
            self._step_waits.close()

    def prepare(self, state: Any) -> None:
        """Make this rank's slots ready for saves of ``state`` in the background (growing,
        mapping and zeroing fresh shared memory costs several copies), so that the first
        save costs what a later one does. ``load`` does this itself, also when there is
        nothing to load; call it after construction when the script does not load. A state
        that grows later still saves (its slots grow then). Never blocks."""
        self._engine.prepare_for(state)

    def load(self, state: Any, *, step: int | None = None, timeout: float | None = None) -> int | None:
        """Fill ``state`` in place from the agreed step; returns it, or None if there is none.

        Tensors are filled in place; plain values are written into the state's dicts and
        lists (call ``optimizer.load_state_dict(state["optim"])`` afterwards for its
        hyper-parameters). All ranks must call this. A step in every rank's memory loads
        without waiting for the saver; a load from storage waits for its crash flush of the
        previous run at most ``timeout`` seconds (default ``FLASHCKPT_SAVER_TIMEOUT``; past
        it :class:`~flashckpt.CheckpointTimeoutError` naming the saver).
        """
        with self._loading():
            return self._engine.load(state, step=step, timeout=timeout)


class DdpCheckpointer(Checkpointer):
    """Flash checkpoints of replicated (DDP) state: local rank 0 of each node keeps the
    node's one copy in memory, every local rank can load from it, and rank 0 alone
    writes the one copy on storage (``rank-0.safetensors``). Same arguments and calls
    as :class:`Checkpointer`."""

    _replicated = True
