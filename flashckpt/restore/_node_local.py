"""The load agreement in node-local mode (see ``flashckpt.replicas._node_local``).

Every rank reports the copies it can see: the steps in its memory slots; its node's local
rank 0 also the peer replicas its node keeps and the committed steps of its node's
directory, with the storage ranks each holds. A copy is named by its (line, step) key
(``flashckpt.storage._local``), so a step number of an abandoned line never stands for a newer
one. :func:`choose` picks the newest key every rank can get from somewhere: its memory, a
peer's memory replica, its own node's directory, or a peer node's directory. Then:

- every rank holds it in memory or as a peer replica: **memory**, as on a shared directory
  (``flashckpt.replicas._engine`` fetches the replicas);
- every rank's own node's directory holds its shard: **storage**, each rank reading its
  own node's directory, with older such steps as fallbacks;
- else each rank without a memory copy first brings its shard into its own memory slot --
  from a peer's replica, its own directory, or a peer node's directory over the replica
  channel (checksums verified on both ends) -- and every rank loads from **memory**; a
  loader that asks for it (``direct``, the engine's own load) has a rank whose own
  directory holds its shard read it from there straight into its tensors instead.

A rank for which no copy of any step the others hold survives is an error naming it,
never a silent start from nothing; so is a run whose number of ranks differs from the one
that saved the steps in the directories (a load here does not reshard: each node's directory
holds the shards of two nodes' ranks of that world).
"""

from __future__ import annotations

import logging
from typing import Any

from ._shard_read import open_shard
from ._sources import Agreement, Key, Source, Sources
from .._errors import CheckpointError, CheckpointNotFoundError
from ..replicas._protocol import ReplicaError
from ..storage._step_meta import line_key
from ..storage._local import LocalStorage

__all__ = ["agree_node_local", "choose", "disk_view", "lacking", "memory_copies"]

log = logging.getLogger("flashckpt")


def disk_view(storage: LocalStorage, world: int) -> dict[str, list]:
    """This node's directory as its first rank reports it to the agreement, reading each
    committed step's metadata once (an unreadable step is left out, and logged): ``disk``,
    the (line, step) and storage ranks of every step ``world`` ranks saved, and
    ``other_worlds``, the (step, number of ranks) of those another number of ranks saved;
    both oldest first."""
    disk, other = [], []
    for step in storage.steps_in_order():
        try:
            meta = storage.metadata(step)
        except CheckpointError as exc:
            log.info("not counting step %d of %s: %s", step, storage.root, exc)
            continue
        if meta["world_size"] == world:
            disk.append(((line_key(meta.get("token")), step), [int(r) for r in meta["shards"]]))
        else:
            other.append((step, meta["world_size"]))
    return {"disk": disk, "other_worlds": other}


def choose(copies: list[set[Key]], step: int | None = None) -> Key | None:
    """The newest key in every rank's set of copies (``step``: the newest line of that step),
    None when there is none. Pure: ``copies[r]`` is what rank ``r`` can get from anywhere."""
    common = set.intersection(*copies) if copies else set()
    if step is not None:
        common = {k for k in common if k[1] == step}
    return max(common, default=None)


def memory_copies(views: list[dict[str, Any]], nodes: tuple[str, ...], endpoints: dict[str, Any]) -> list[set[Key]]:
    """Per rank, the keys it can load from memory: its own slots' (``mine``) and the replicas of
    its storage rank that a node with a replica endpoint keeps. Pure: the one definition of a
    copy in memory, for shared and node-local directories alike."""
    held = {(storage_rank, tuple(key)) for r, view in enumerate(views) if nodes and endpoints.get(nodes[r])
            for storage_rank, _, key in view["replicas"]}
    return [{tuple(k) for k in view["mine"]} | {k for sr, k in held if sr == view["storage_rank"]} for view in views]


def lacking(copies: list[set[Key]]) -> str:
    """Why no key is common: the newest key anyone holds, and the ranks that cannot get it."""
    newest = max(set().union(*copies))
    ranks = [r for r, have in enumerate(copies) if newest not in have]
    return (f"step {newest[1]} (the newest any rank holds) has no copy anywhere for rank(s) "
            f"{', '.join(map(str, ranks))}, and no older step has a copy for every rank")


def agree_node_local(sources: Sources, views: list[dict[str, Any]], step: int | None, *,
                     direct: bool = False) -> Agreement:
    """The agreement of the module docstring, from every rank's ``views`` (see
    ``flashckpt.restore._agreement.agree``); all ranks call it with the same views.
    ``direct``: a rank without a memory copy whose own node's directory holds its shard
    reads it from there at load, straight into the caller's tensors (one copy), rather than
    bringing it into its slot first (``Agreement.own_disk``)."""
    nodes = sources.placement.nodes
    endpoints = sources.replicas.endpoints
    replicas: dict[tuple[int, Key], list] = {}
    disks: dict[str, dict[Key, set[int]]] = {}
    for rank, view in enumerate(views):
        for storage_rank, _, key in view["replicas"]:
            replicas.setdefault((storage_rank, tuple(key)), []).append(endpoints.get(nodes[rank]))
        if view["disk"] is not None:
            disks[nodes[rank]] = {tuple(key): set(ranks) for key, ranks in view["disk"]}
    mine = [{tuple(k) for k in view["mine"]} for view in views]
    in_memory = memory_copies(views, nodes, endpoints)
    own_disk = [{k for k, ranks in disks.get(nodes[r], {}).items() if view["storage_rank"] in ranks}
                for r, view in enumerate(views)]
    on_disks = [{k for d in disks.values() for k, ranks in d.items() if view["storage_rank"] in ranks} for view in views]
    anywhere = [in_memory[r] | on_disks[r] for r in range(len(views))]
    stored = sorted(set.intersection(*own_disk), reverse=True)
    committed = stored[0][1] if stored else None
    what = f"step {step}" if step is not None else "a step"
    key = choose(anywhere, step)
    if key is None:
        if step is not None or any(anywhere):
            raise CheckpointNotFoundError(f"cannot restore {what} of the node-local directories {sources.storage.root} "
                                          f"on every rank: {lacking(anywhere) if any(anywhere) else 'none'}")
        _no_resharding(views, nodes, sources.storage.root, len(views))
        return Agreement(None, None, None)
    if all(key in have for have in in_memory):
        agreed = key[1]
        holders = sources.replicas.holders(views)
        fetched, where = sources.replicas.fetch_missing(key[1], holders, committed)
        if where == Source.MEMORY:
            return Agreement(key[1], Source.MEMORY, committed, tuple(k[1] for k in stored if k != key))
        key = choose(on_disks, step)  # fetching failed (warned): the newest step some directory holds for every rank
        if key is None:
            raise CheckpointNotFoundError(
                f"fetching step {agreed} from peer memory failed, and no node-local directory under "
                f"{sources.storage.root} can give every rank {what}: "
                f"{lacking(on_disks) if any(on_disks) else 'no step is on disk'}")
    if key in stored:
        return Agreement(key[1], Source.STORAGE, committed, tuple(k[1] for k in stored if k != key))
    me, where = sources.collective.rank, views[sources.collective.rank]
    peers = [endpoints[node] for node, d in disks.items()
             if node != nodes[me] and key in d and where["storage_rank"] in d[key] and node in endpoints]
    reads_disk = [r for r in range(len(views)) if direct and key not in mine[r] and key in own_disk[r]]
    sources.on_all_ranks(lambda: None if key in mine[me] or me in reads_disk else _bring(sources, key, replicas.get(
        (where["storage_rank"], key), []), key in own_disk[me], peers), f"restoring step {key[1]} on every rank")
    return Agreement(key[1], Source.MEMORY, committed, (), frozenset(views[r]["storage_rank"] for r in reads_disk))


def _no_resharding(views: list[dict[str, Any]], nodes: tuple[str, ...], root: str, world: int) -> None:
    """Nothing this run's ``world`` ranks saved anywhere, but a node's directory holds steps
    another number of ranks saved: a :class:`CheckpointError` naming them, never a silent
    fresh start (a load across node-local directories does not reshard)."""
    found = [(step, saved, nodes[r]) for r, view in enumerate(views) for step, saved in view.get("other_worlds") or []]
    if found:
        step, saved, _ = max(found)
        holders = sorted({node for s, w, node in found if (s, w) == (step, saved)})
        raise CheckpointError(
            f"the node-local directories {root} hold step {step} saved by {saved} ranks (on node(s) "
            f"{', '.join(holders)}), and nothing saved by this run's {world}: a load across node-local directories "
            f"cannot change the number of ranks (each directory holds two nodes' shards of that world, and this "
            f"run would start from nothing); restart with {saved} ranks, or start this run in another directory")


def _bring(sources: Sources, key: Key, holders: list, own: bool, peers: list) -> None:
    """Bring this rank's copy of ``key`` into its own memory slot: from a peer's replica, its
    own node's directory, or a peer node's directory, the first that works."""
    step, failures = key[1], []
    for endpoint in [e for e in holders if e is not None]:
        try:
            sources.replicas.fetch_from(endpoint, step)
            return
        except (CheckpointError, OSError) as exc:
            failures.append(f"replica on {endpoint[0]}:{endpoint[1]}: {exc}")
    if own:
        try:
            _read_own(sources, step)
            return
        except (CheckpointError, OSError) as exc:
            failures.append(f"{sources.storage.root}: {exc}")
    for endpoint in peers:
        try:
            sources.replicas.fetch_from(endpoint, step, op="fetch_shard", line=key[0])
            log.info("fetched step %d of rank %d from the directory of %s:%d", step,
                     sources.placement.storage_rank, *endpoint)
            return
        except (CheckpointError, OSError) as exc:
            failures.append(f"directory of {endpoint[0]}:{endpoint[1]}: {exc}")
    raise ReplicaError(f"no copy of step {step} rank {sources.placement.storage_rank} could be restored: "
                       + "; ".join(failures))


def _read_own(sources: Sources, step: int) -> None:
    """Read this rank's committed shard of ``step`` from its own node's directory into its
    slot through the shard reader a load from storage uses (every block verified against
    the checksums recorded at commit)."""
    meta = sources.storage.metadata(step)
    with open_shard(sources.storage, step, sources.placement.storage_rank, whole=True) as reader:
        into, done = sources.replicas.slot_writer(step)
        reader.read_all([(0, into(reader.size, {"token": meta.get("token"), "branch": meta.get("branch", -1)}))])
        done()
