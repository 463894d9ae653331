"""The load agreement: which step every rank loads, and from where (one rule, every adapter).

All ranks of a job must load the same step. The rule (DESIGN.md, "Agreement on load"):

- **memory** when every rank holds the step -- in its own node's slots or as a peer's
  replica (``flashckpt.replicas._engine``) -- and that copy is not older, by (line, step),
  than the newest committed step; ranks whose node lacks it then fetch it from a peer;
- else **storage**: the newest committed step, with the older committed steps (newest
  first) as fallbacks should it prove damaged;
- ``step=`` asked explicitly: memory if every rank holds it, else storage, no fallbacks.

Node-local directories (no directory shared by the nodes, see ``flashckpt.replicas._node_local``)
count every node's directory and a peer node's directory as sources too
(``flashckpt.restore._node_local``).

:func:`agree` is collective (every rank calls it, and every rank gets the same
:class:`Agreement`); a rank's failure while looking (storage unreadable, a fetch that
fails) reaches every rank as one exception, never a rank left waiting in a collective.
It only decides (and fetches missing replicas): loading the bytes is the adapter's
(``Engine.load_agreed`` for the engine's own format, the FSDP and megatron readers for
theirs), since adapters read different things from the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._engine import Engine

__all__ = ["Agreement", "Source", "agree", "memory_not_older"]


class Source(str, Enum):
    """Where an agreed step is read from."""

    MEMORY = "memory"
    STORAGE = "storage"

    def __str__(self) -> str:  # "memory" in messages and events, on every Python
        return self.value

    __format__ = str.__format__


@dataclass(frozen=True, slots=True)
class Agreement:
    """What every rank loads; the same object on every rank."""

    step: int | None
    """The step to load; None when nothing is in memory or on storage (a fresh start)."""
    source: Source | None
    """Memory (every rank holds ``step`` in its slots now) or storage; None with no step."""
    committed: int | None
    """The newest committed step (what a failed load from memory falls back to)."""
    fallbacks: tuple[int, ...] = ()
    """Older committed steps to try, newest first, should ``step`` fail to load from
    storage as damaged; empty when the step was asked for."""

    def pinned(self) -> "Agreement":
        """This agreement without fallbacks: for a caller that checked ``step`` already
        (its layout) and must load exactly that step."""
        return replace(self, fallbacks=())

    def from_storage(self) -> "Agreement":
        """The same step read from storage (memory does not serve this caller)."""
        return replace(self, source=Source.STORAGE)


def memory_not_older(memory: tuple[str, int], newest: tuple[str, int] | None) -> bool:
    """Memory wins unless storage holds a newer (line, step)."""
    return newest is None or memory >= newest


def agree(engine: "Engine", step: int | None = None) -> Agreement:
    """Agree with every rank on the step to load (see the module docstring); fetches the
    agreed step from peer replicas on ranks whose node lacks it. All ranks must call this.
    Node-local directories follow ``flashckpt.restore._node_local``."""
    from ._node_local import agree_node_local, disk_copies  # it builds on this module
    engine._prepared()  # no slot is being created in the background while a replica is fetched into one
    engine._client.wait()  # a crash flush of the previous run finishes first
    rank0 = engine.collective.rank == 0

    node_local = engine.node_local is not None

    def look() -> dict:
        storage, p = engine.storage, engine.placement
        view = {"memory": sorted(engine.memory_steps()), "keys": engine.memory_keys() if rank0 else None,
                "committed": storage.steps_in_order()[::-1] if rank0 else None,
                "newest": storage.newest_key() if rank0 else None,
                "storage_rank": p.storage_rank, "replicas": engine.replicas.here()}
        if node_local:  # every node's directory differs: each node's first rank reports its own
            view.update(mine=sorted(engine.memory_keys().values()),
                        disk=disk_copies(storage, p.storage_world) if p.local_rank == 0 else None)
        return view

    views = engine.on_all_ranks(look, f"looking for checkpoints of {engine.storage.root} to load")
    if node_local:
        return agree_node_local(engine, views, step)
    order: list[int] = views[0]["committed"]
    committed = order[0] if order else None
    holders, keys = engine.replicas.holders(views)  # a peer's replica counts as a copy in memory
    common = set.intersection(*(set(v["memory"]) | {s for r, s in holders if r == v["storage_rank"]}
                                for v in views))
    if step is not None:
        source = Source.MEMORY if step in common else Source.STORAGE
        fallbacks: tuple[int, ...] = ()
    elif common and memory_not_older(keys[max(common)], views[0]["newest"]):
        step, source, fallbacks = max(common), Source.MEMORY, tuple(order)
    elif committed is not None:
        step, source, fallbacks = committed, Source.STORAGE, tuple(order)
    else:
        return Agreement(None, None, None)
    if source == Source.MEMORY and any(step not in v["memory"] for v in views):
        fetched, where = engine.replicas.fetch_missing(step, holders, committed)
        if where != Source.MEMORY:
            step, source = fetched, Source.STORAGE
    return Agreement(step, source, committed, tuple(s for s in fallbacks if s != step))
