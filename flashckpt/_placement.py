"""Where each rank's state lives: its node, its memory slots, its storage shard.

:func:`place` is the one collective call that decides it at construction: every rank
learns each rank's node (ranks that share a ``/dev/shm`` are one node), the run's token
(rank 0 draws it; it keeps shards of different runs apart) and the run's replica secret.
Whether the checkpoint directory is shared by the nodes is checked afterwards, on
storage (``flashckpt.replicas._node_local``).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import _names
from .replicas._protocol import new_secret

__all__ = ["Collective", "Placement", "SingleProcess", "new_token", "next_line_token", "node_id", "place"]


class Collective(Protocol):
    """How the ranks of a job exchange small picklable objects (a process group)."""

    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...


class SingleProcess:
    rank = 0
    world_size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one process's state lives, in memory and on storage."""

    local_rank: int
    memory_rank: int
    """The local rank whose slots hold this process's state (0 for replicated state)."""
    writes_memory: bool
    storage_rank: int
    storage_world: int
    persists: bool
    token: str
    """Shared by all ranks of one run; keeps shards of different runs from mixing."""
    nodes: tuple[str, ...] = ()
    """Each rank's node (``node_id``), in rank order."""
    secret: str = field(default="", repr=False)
    """The run's replica secret (rank 0 draws it); only the job's processes learn it."""


def new_token() -> str:
    """A run's token: unique, and ordered by the time the run started (its line, see
    ``flashckpt.storage._local``)."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:8]}"


def next_line_token(token: str) -> str:
    """The token of a new line that a run starts when it rolls back in the same process
    (loads an older step after saving): ordered after every step the run saved so far and,
    one nanosecond on, before any later run's. Every rank derives the same one."""
    return f"{int(token[:16], 16) + 1:016x}{token[16:]}"


def node_id() -> str:
    """Ranks on one node share a /dev/shm; a private tmpfs (container, namespace) is another node."""
    return f"{socket.gethostname()}:{os.stat(_names.SHM_DIR).st_dev}"


def place(collective: Collective, *, replicated: bool) -> Placement:
    """Where each rank's state lives; a collective call (every rank calls it).

    Own state: every rank keeps its slots and writes ``rank-<R>``. Replicated state: local
    rank 0 of each node keeps the node's copy and rank 0 alone writes ``rank-0``.
    """
    me = (node_id(), (new_token(), new_secret()) if collective.rank == 0 else None)
    everyone = collective.all_gather(me)
    local_rank = sum(1 for node, _ in everyone[:collective.rank] if node == me[0])
    token, secret = everyone[0][1]
    nodes = tuple(node for node, _ in everyone)
    if replicated:
        return Placement(local_rank=local_rank, memory_rank=0, writes_memory=local_rank == 0,
                         storage_rank=0, storage_world=1, persists=collective.rank == 0, token=token,
                         nodes=nodes, secret=secret)
    return Placement(local_rank=local_rank, memory_rank=local_rank, writes_memory=True,
                     storage_rank=collective.rank, storage_world=collective.world_size,
                     persists=True, token=token, nodes=nodes, secret=secret)
