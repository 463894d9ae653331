"""The DeepSpeed ``CheckpointEngine`` that turns ``engine.save_checkpoint`` into a flash save.

Call protocol inside ``DeepSpeedEngine.save_checkpoint`` (DeepSpeed 0.19): every rank
calls ``create(info)``, then ``save(state_dict, path)`` for each of its files (model
states on the writers, ZeRO optimizer states on every rank), then ``commit(info)``.
``save`` only keeps a reference to the state dict; ``commit`` copies every state dict
of the rank into shared memory in one flash save (the only blocking copy) and lets the
node's saver persist it and write DeepSpeed's own files in the background.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from .._errors import CheckpointError
from ..storage._location import is_url

__all__ = ["FlashCheckpointEngine", "OnCommit", "local_only", "step_boundary", "unwrap_step"]

OnCommit = Callable[[str, str, dict[str, Any], bool], None]
"""``on_commit(tag, save_dir, files, save_latest)``: ``files`` maps each path relative to
``save_dir`` to the state dict DeepSpeed handed over for it (by reference)."""

log = logging.getLogger(__name__)

ENGINE_NAME = "FlashCheckpointEngine"


@dataclass(slots=True)
class _Pending:
    tag: str
    save_dir: str
    files: dict[str, Any] = field(default_factory=dict)
    """Path relative to ``save_dir`` -> the state dict DeepSpeed handed over (by reference)."""


class FlashCheckpointEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that hands each tag's state dicts to ``on_commit``.

    Installed on the DeepSpeed engine by :class:`DeepSpeedCheckpointer` (``on_commit``
    makes one flash save) or, for the length of one save, by the Hugging Face callback
    (``on_commit`` adds the files to the Trainer's snapshot). ``load(path)`` returns the
    state dict from the checkpointer's agreed step while
    :meth:`DeepSpeedCheckpointer.load` runs (memory or flashckpt storage), and falls
    back to ``torch.load`` of the DeepSpeed file otherwise, like the default engine.
    """

    def __init__(self, on_commit: OnCommit) -> None:
        super().__init__(None)
        self.name = ENGINE_NAME
        self._on_commit = on_commit
        self._pending: _Pending | None = None
        self.served: dict[str, Any] = {}
        """Absolute path -> state dict, filled by the checkpointer for the length of a load."""

    def create(self, info: CheckpointCommitInfo) -> None:
        if self._pending is not None:
            log.warning("checkpoint tag %s was created but never committed; dropping it", self._pending.tag)
        self._pending = _Pending(tag=str(info.tag), save_dir=_local(info.save_dir))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        _local(path)
        pending = self._pending
        if pending is not None and _inside(os.path.abspath(path), os.path.join(pending.save_dir, pending.tag)):
            return  # the exporter creates the tag directory once the step is durable
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        pending = self._pending
        if pending is None:
            raise CheckpointError(f"{ENGINE_NAME}.save({path!r}) outside create()/commit()")
        full = os.path.abspath(path)
        if not _inside(full, os.path.join(pending.save_dir, pending.tag)):
            raise CheckpointError(f"{ENGINE_NAME}.save: {full} is not inside the tag directory "
                                  f"{os.path.join(pending.save_dir, pending.tag)}")
        pending.files[os.path.relpath(full, pending.save_dir)] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        pending, self._pending = self._pending, None
        if pending is None or pending.tag != str(info.tag):
            raise CheckpointError(f"{ENGINE_NAME}.commit({info.tag!r}) without a matching create()")
        self._on_commit(pending.tag, pending.save_dir, pending.files, bool(info.save_latest))
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        state = self.served.get(os.path.abspath(path))
        if state is not None:
            return state
        import torch
        if not os.path.exists(path):
            raise CheckpointError(f"DeepSpeed checkpoint file {path} is neither in the step being loaded "
                                  "nor on storage")
        return torch.load(path, map_location=map_location, weights_only=False)

    def preserves_storage_sharing(self) -> bool:
        return False  # we copy once, into shared memory; DeepSpeed need not clone first

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0


def _local(save_dir: str) -> str:
    """The absolute path of a local ``save_dir``; a URL is refused before DeepSpeed opens
    files under it as a local path (its recovery scripts, ``latest``)."""
    if is_url(save_dir):
        raise CheckpointError(f"engine.save_checkpoint({save_dir!r}): DeepSpeed writes files of its own under "
                              "save_dir, which cannot be an object-store URL; call DeepSpeedCheckpointer.save, "
                              "which puts the tag into the checkpointer's bucket")
    return os.path.abspath(save_dir)


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


@contextmanager
def local_only(engine: Any) -> Iterator[None]:
    """DeepSpeed's ``save_checkpoint`` on this thread without its collectives, for a failure
    capture (a peer may be dead; every rank's files are its own under ZeRO 0-3): ``barrier``,
    the tag check (``engine._checkpoint_tag_validation``) and ZeRO-3's re-gather of its
    persistent parameters after the save (the optimizer's ``checkpoint_event_epilogue``; the
    process is failing, and its forward gathers them anyway) do nothing here, and stay
    themselves on every other thread."""
    import deepspeed.comm as ds_comm

    me = threading.get_ident()
    barrier = ds_comm.barrier

    def local_barrier(*args: Any, **kwargs: Any) -> Any:
        return None if threading.get_ident() == me else barrier(*args, **kwargs)

    ds_comm.barrier = local_barrier
    try:
        with _skipped_here(engine, "_checkpoint_tag_validation", me), \
                _skipped_here(engine.optimizer, "checkpoint_event_epilogue", me):
            yield
    finally:
        ds_comm.barrier = barrier


@contextmanager
def _skipped_here(obj: Any, name: str, thread: int) -> Iterator[None]:
    """``obj.<name>(...)`` does nothing on ``thread`` (set on the instance; put back after)."""
    stock = getattr(obj, name, None)
    if stock is None:
        yield
        return
    own = obj.__dict__.get(name)  # set on the instance before (else the class's)

    def skipped(*args: Any, **kwargs: Any) -> Any:
        return None if threading.get_ident() == thread else stock(*args, **kwargs)

    setattr(obj, name, skipped)
    try:
        yield
    finally:
        if own is None:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, own)


def step_boundary(engine: Any, capture: Any, *, counts: bool = True) -> Callable[..., Any]:
    """Wrap ``engine.step`` on the engine instance so that a step at a gradient-accumulation
    boundary is ``capture``'s update (``FailureCapture.update_begins``; ``update_ends`` with
    ``counts``, else the caller ends it); returns the wrapper, for :func:`unwrap_step`.
    (DeepSpeed's ZeRO optimizers have no torch step hooks, and their torch optimizer's
    finish before the updated fp32 partitions are copied into the model.)"""
    stock_step = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        if not engine.is_gradient_accumulation_boundary():
            return stock_step(*args, **kwargs)
        capture.update_begins()  # waits while a capture copies
        result = stock_step(*args, **kwargs)
        if counts:
            capture.update_ends()  # not reached when the update raised: nothing is captured then
        return result

    engine.step = step
    return step


def unwrap_step(engine: Any, wrapper: Any) -> None:
    """The class's ``engine.step`` again, where ``wrapper`` is still the instance's."""
    if wrapper is not None and engine.__dict__.get("step") is wrapper:
        del engine.__dict__["step"]
