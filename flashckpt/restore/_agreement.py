"""The load agreement: which step every rank loads, and from where (one rule, every adapter).

All ranks of a job must load the same step. The rule (DESIGN.md, "Agreement on load"):

- **memory** when every rank holds the step -- in its own node's slots or as a peer's
  replica (``flashckpt.replicas._engine``) -- and that copy is not older, by (line, step),
  than the newest committed step; ranks whose node lacks it then fetch it from a peer;
- else **storage**: the newest committed step, with the older committed steps (newest
  first) as fallbacks should it prove damaged;
- ``step=`` asked explicitly: memory if every rank holds it, else storage, no fallbacks.

A copy in memory is named by its (line, step) key, the same for shared and node-local
directories (``flashckpt.restore._node_local.memory_copies``): the newest key every rank
holds is the memory candidate, so a step number of an abandoned line never stands for it.

Node-local directories (no directory shared by the nodes, see ``flashckpt.replicas._node_local``)
count every node's directory and a peer node's directory as sources too
(``flashckpt.restore._node_local``).

:func:`agree` is collective (every rank calls it, and every rank gets the same
:class:`Agreement`); a rank's failure while looking (storage unreadable, a fetch that
fails) reaches every rank as one exception, never a rank left waiting in a collective.
It only decides (and fetches missing replicas): loading the bytes is the adapter's
(``flashckpt.restore._load`` for the engine's own format, the FSDP and megatron readers
for theirs), since adapters read different things from the same step. It works with the
rank's parts (:class:`~flashckpt.restore._sources.Sources`), never the engine.

The saver's crash flush of a previous run (its trainer died with a persist asked) may be
about to commit a step newer than storage shows. It only ever writes what that run left in
memory, so it cannot make storage newer than a memory copy every rank holds: an agreement on
memory stands without waiting for it (a stopped or busy saver does not delay that restart).
Only when the agreement is storage (or nothing) does every rank wait for the flush, at most
``timeout`` seconds, and agree again; every rank gets the same agreement, so every rank
takes the same branch.
"""

from __future__ import annotations

import logging
from typing import Any

from ._node_local import agree_node_local, choose, disk_view, memory_copies
from ._sources import Agreement, Key, Source, Sources, captured_keys, memory_keys, memory_not_older

__all__ = ["agree"]

log = logging.getLogger(__name__)


def agree(sources: Sources, step: int | None = None, *, direct: bool = False,
          timeout: float | None = None) -> Agreement:
    """Agree with every rank on the step to load (see the module docstring); fetches the
    agreed step from peer replicas on ranks whose node lacks it. All ranks must call this.
    Node-local directories follow ``flashckpt.restore._node_local`` (``direct``: a loader
    that reads ``Agreement.own_disk``, see there). ``timeout``: at most this many seconds
    waiting for the saver's crash flush (default ``FLASHCKPT_SAVER_TIMEOUT``), past it
    :class:`~flashckpt.CheckpointTimeoutError` naming the saver, on every rank."""
    sources.ready()  # no slot is prepared while a replica is fetched into one
    agreement, views = _agree_now(sources, step, direct)
    if agreement.source != Source.MEMORY:
        sources.on_all_ranks(lambda: sources.flushed(timeout), "waiting for the saver's crash flush of the previous run")
        agreement, views = _agree_now(sources, step, direct)
    if sources.collective.rank == 0:
        _say_why_a_capture_is_not_loaded(views, agreement, step)
    if sources.node_local is not None and agreement.source == Source.MEMORY and sources.placement.local_rank == 0 \
            and agreement.step in sources.slots.steps():  # before any flush of it (the load's collectives follow)
        sources.node_local.adopt_line(sources.storage.root, sources.slots.info(agreement.step).get("token"))
    return agreement


def _say_why_a_capture_is_not_loaded(views: list[dict], agreement: Agreement, asked: int | None) -> None:
    """One line (rank 0) when a failure capture newer than the agreed step is left: which
    step was captured, which is loaded, and why."""
    captured: dict[Key, list[int]] = {}
    for rank, view in enumerate(views):
        for key in view.get("captured", ()):
            captured.setdefault(tuple(key), []).append(rank)
    if not captured:
        return
    key = max(captured)
    step = key[1]
    if agreement.step is not None and step <= agreement.step:
        return
    if asked is not None:
        why = f"step {asked} was asked for"
    elif not memory_not_older(key, views[0]["newest"]):
        why = f"storage holds a newer line (committed step {agreement.committed})"
    else:
        lacking = [r for r, view in enumerate(views) if step not in view["memory"]]
        why = (f"rank(s) {', '.join(map(str, lacking))} hold no copy of it (a rank that died or was inside an "
               f"update captures nothing, and this state needs every rank's copy)") if lacking \
            else "not every rank could load it"
    loaded = "nothing (a fresh start)" if agreement.step is None else f"step {agreement.step} from {agreement.source}"
    log.warning("step %d was captured at a failure on rank(s) %s, but loading %s: %s", step,
                ", ".join(map(str, captured[key])), loaded, why)


def _agree_now(sources: Sources, step: int | None, direct: bool) -> tuple[Agreement, list[dict]]:
    """One agreement on what memory and storage hold now (collective)."""
    rank0 = sources.collective.rank == 0
    node_local = sources.node_local is not None

    def look() -> dict:
        storage, p = sources.storage, sources.placement
        keys = memory_keys(sources.slots)
        view = {"memory": sorted(keys), "mine": sorted(keys.values()), "captured": captured_keys(sources.slots),
                "committed": storage.steps_in_order()[::-1] if rank0 else None,
                "newest": storage.newest_key() if rank0 else None,
                "storage_rank": p.storage_rank, "replicas": sources.replicas.here()}
        if node_local:  # every node's directory differs: each node's first rank reports its own
            view.update(disk_view(storage, p.storage_world) if p.local_rank == 0 else
                        {"disk": None, "other_worlds": None})
        return view

    views = sources.on_all_ranks(look, f"looking for checkpoints of {sources.storage.root} to load")
    return _decide(sources, views, step, direct), views


def _decide(sources: Sources, views: list[dict[str, Any]], step: int | None, direct: bool) -> Agreement:
    """The agreement every rank reaches from every rank's ``views`` (no collective but a fetch)."""
    if sources.node_local is not None:
        return agree_node_local(sources, views, step, direct=direct)
    order: list[int] = views[0]["committed"]
    committed = order[0] if order else None
    in_memory = choose(memory_copies(views, sources.placement.nodes, sources.replicas.endpoints), step)
    if step is not None:
        source = Source.MEMORY if in_memory is not None else Source.STORAGE
        fallbacks: tuple[int, ...] = ()
    elif in_memory is not None and memory_not_older(in_memory, views[0]["newest"]):
        step, source, fallbacks = in_memory[1], Source.MEMORY, tuple(order)
    elif committed is not None:
        step, source, fallbacks = committed, Source.STORAGE, tuple(order)
    else:
        return Agreement(None, None, None)
    if source == Source.MEMORY and any(step not in v["memory"] for v in views):
        holders = sources.replicas.holders(views)
        fetched, where = sources.replicas.fetch_missing(step, holders, committed)
        if where != Source.MEMORY:
            step, source = fetched, Source.STORAGE
    return Agreement(step, source, committed, tuple(s for s in fallbacks if s != step))
