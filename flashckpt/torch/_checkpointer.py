"""Flash checkpointers for torch: every rank's own state, or replicated (DDP) state."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from .. import _names
from .._engine import Engine, LoadInfo, Options, Placement, SingleProcess, new_token
from . import _tensors  # noqa: F401  (registers the torch tensor kind)

__all__ = ["Checkpointer", "DdpCheckpointer"]


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


def _node_id() -> str:
    """Ranks on one node share a /dev/shm; a private tmpfs (container, namespace) is another node."""
    return f"{socket.gethostname()}:{os.stat(_names.SHM_DIR).st_dev}"


class Checkpointer:
    """Flash checkpoints of a state that every rank holds its own part of.

    ``save(step, state)`` blocks only while the tensors of ``state`` are copied into
    this rank's shared memory; a saver process on the node writes
    ``<directory>/step-<N>/rank-<R>.safetensors`` in the background every
    ``persist_every`` saves, and commits the step once every rank's shard is durable.
    ``load(state)`` fills the tensors of ``state`` in place from the newest step that
    every rank holds in memory, or else from the newest committed step on storage.

    With ``torch.distributed`` initialised, every rank must construct the checkpointer
    and call ``load`` (they agree on one step); ``save`` needs no communication. A
    state is any nesting of dict / list / tuple with tensors and int, float, str, bool
    or None leaves. Also a context manager: leaving it calls :meth:`close`.
    """

    _replicated = False

    def __init__(self, directory: str | os.PathLike, *, persist_every: int = 1, keep_last: int = 3,
                 job_id: str | None = None, allow_pickle: bool = False, process_group: Any = None) -> None:
        options = Options(persist_every=persist_every, keep_last=keep_last, job_id=job_id, allow_pickle=allow_pickle)
        if dist.is_available() and dist.is_initialized():
            collective = ProcessGroupCollective(process_group)
        else:
            collective = SingleProcess()
        me = (_node_id(), new_token() if collective.rank == 0 else None)
        everyone = collective.all_gather(me)
        local_rank = sum(1 for node, _ in everyone[:collective.rank] if node == me[0])
        token = everyone[0][1]
        if self._replicated:
            placement = Placement(local_rank=local_rank, memory_rank=0, writes_memory=local_rank == 0,
                                  storage_rank=0, storage_world=1, persists=collective.rank == 0, token=token)
        else:
            placement = Placement(local_rank=local_rank, memory_rank=local_rank, writes_memory=True,
                                  storage_rank=collective.rank, storage_world=collective.world_size,
                                  persists=True, token=token)
        self._engine = Engine(os.fspath(directory), options, placement, collective)

    @property
    def directory(self) -> str:
        return self._engine.storage.root

    @property
    def job_id(self) -> str:
        """Names this job's shared memory on the node (see ``flashckpt ls``/``gc``)."""
        return self._engine.job_id

    @property
    def last_load(self) -> LoadInfo | None:
        """Step, source ("memory" / "storage" / None) and seconds of the last :meth:`load`."""
        return self._engine.last_load

    def save(self, step: int, state: Any, *, persist: bool | None = None) -> None:
        """Copy ``state`` into shared memory; persist it if due (or if ``persist``)."""
        self._engine.save(step, state, persist=persist)

    def load(self, state: Any, *, step: int | None = None) -> int | None:
        """Fill ``state`` in place from the agreed step; returns it, or None if there is none.

        Tensors are filled in place; plain values are written into the state's dicts and
        lists (call ``optimizer.load_state_dict(state["optim"])`` afterwards for its
        hyper-parameters). All ranks must call this.
        """
        return self._engine.load(state, step=step)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every persist asked for so far is durable (raises what failed)."""
        self._engine.wait(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Persist the newest in-memory step now if it is not on storage yet, and wait."""
        self._engine.flush(timeout)

    def latest_step(self) -> int | None:
        """The newest step committed on storage."""
        return self._engine.latest_step()

    def close(self) -> None:
        """Persist the newest step if needed, wait for storage, free shared memory."""
        self._engine.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DdpCheckpointer(Checkpointer):
    """Flash checkpoints of replicated (DDP) state: local rank 0 of each node keeps the
    node's one copy in memory, every local rank can load from it, and rank 0 alone
    writes the one copy on storage (``rank-0.safetensors``). Same arguments and calls
    as :class:`Checkpointer`."""

    _replicated = True
