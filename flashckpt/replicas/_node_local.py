"""Node-local checkpoint directories with peer replicas: each node commits its own scope.

A job whose nodes do not share the checkpoint directory (each node has its own disk at
that path) cannot commit a step across nodes: no node sees the others' shards. Without
replicas such a directory fails construction on every rank, naming the nodes that do not
see rank 0's probe (a clear error rather than shards that never commit). With peer
replicas (``replicas=1``, the default on two or more nodes) the job switches to
**node-local mode** instead, and every rank agrees on it in the construction collective
(a directory some nodes share and others do not fails construction, naming them):

- **Scope.** Node ``k``'s directory commits the shards of the ranks it is responsible
  for: its own persisting ranks and those of its ring predecessor ``k - 1`` (whose newest
  steps it receives as peer replicas, see ``flashckpt.replicas._protocol``). The scope is written to
  ``<dir>/.flashckpt-node-local.json`` under the run's token; :meth:`LocalStorage.try_commit`
  reads it and commits ``step-N`` once the scope's shards are durable, recording the scope
  as ``ranks`` in the metadata. A node's ``step-N`` is complete for its scope, never half.
- **Replicas on disk.** The saver that receives a replica of a save that was due for
  storage writes it to its own directory too, in the background, after it arrived
  (``flashckpt.replicas._service``). The directory must therefore be at the same path on
  every node (checked here).
- **Load.** The agreement (``flashckpt.restore._agreement``) gathers, per rank, every copy of
  every step: its memory, a peer's memory replica, its node's directory, a peer node's
  directory (fetched over the replica channel), and picks the newest step every rank can
  get; a step no copy of which survives for some rank is an error naming the ranks, never
  a silent restart from nothing.
- ``latest_step()`` in node-local mode is the newest step committed on this node.

The loss of any one node leaves every rank's newest replicated step on a survivor, in its
memory and (for saves due for storage) on its disk. Losing two adjacent nodes at once
loses the first one's ranks.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import CheckpointError
from ..storage._files import open_regular, read_bounded, write_atomic
from .._placement import Collective, Placement, node_id
from ._protocol import ReplicaError, connect_peer

__all__ = ["SCOPE_FILE", "Flushing", "NodeLocal", "check_directory", "read_scope", "write_scope"]

log = logging.getLogger("flashckpt")

SCOPE_FILE = ".flashckpt-node-local.json"
_SCOPES_KEPT = 8
"""Scopes of this many recent runs stay readable (a crash flush of an earlier run still commits)."""
_MAX_SCOPE = 1 << 20
_PROBE_SECONDS = 5.0
_REMEDY = ("give every node the same directory (a shared file system), an object-store URL, or a replica address "
           "the other nodes reach (FLASHCKPT_REPLICA_ADDR)")


def read_scope(root: str, token: str) -> list[int] | None:
    """The storage ranks run ``token`` commits in this node-local directory; None when the
    directory is not node-local for that run (a shared directory commits every rank)."""
    where = os.path.join(root, SCOPE_FILE)
    try:
        fd = open_regular(where, where)
    except CheckpointError:
        return None
    try:
        scopes = json.loads(read_bounded(fd, _MAX_SCOPE, where))
    except (CheckpointError, ValueError):
        log.warning("%s is unreadable: run %s commits every rank there", where, token)
        return None
    finally:
        os.close(fd)
    entry = scopes.get(token) if isinstance(scopes, dict) else None
    ranks = entry.get("ranks") if isinstance(entry, dict) else None
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, int) and r >= 0 for r in ranks):
        return None
    return sorted(set(ranks))


def write_scope(root: str, token: str, ranks: list[int]) -> None:
    """Record that run ``token`` commits ``ranks`` in this node's directory (one writer per
    node, at construction; the newest runs' scopes are kept)."""
    where = os.path.join(root, SCOPE_FILE)
    scopes: dict[str, Any] = {}
    try:
        fd = open_regular(where, where)
        try:
            loaded = json.loads(read_bounded(fd, _MAX_SCOPE, where))
            scopes = loaded if isinstance(loaded, dict) else {}
        finally:
            os.close(fd)
    except (CheckpointError, ValueError):
        pass
    scopes[token] = {"ranks": sorted(set(ranks)), "written_at": time.time()}
    newest = sorted(scopes, key=lambda t: scopes[t].get("written_at", 0) if isinstance(scopes[t], dict) else 0)
    kept = {t: scopes[t] for t in newest[-_SCOPES_KEPT:]}
    write_atomic(where, json.dumps(kept, indent=1).encode())


def _committed_by(storage: Any, step: int, token: str) -> bool:
    """Whether ``step`` is committed in ``storage`` by run ``token`` (not a newer line's step)."""
    try:
        return storage.metadata(step).get("token") == token
    except CheckpointError:
        return False


class Flushing(Protocol):
    """The rank a node-local flush persists (the engine's public side)."""

    storage: Any
    """This node's directory (``flashckpt.storage._local.LocalStorage``)."""
    placement: Placement
    replicas: Any
    """Its peer replicas (``flashckpt.replicas._engine.PeerReplicas``), whose ``copies`` the flush waits for."""

    def memory_keys(self) -> dict[int, tuple[str, int]]: ...

    def memory_info(self, step: int) -> dict[str, Any]: ...

    def persist(self, step: int) -> None: ...

    def wait(self, timeout: float | None = None, *, copies: bool = True) -> None:
        """Until this rank's persists are done (``copies``: and their node-local copies; a flush
        waits for those itself, :meth:`NodeLocal.settle`)."""


@dataclass(frozen=True, slots=True)
class NodeLocal:
    """This run's node-local mode: which storage ranks each node's directory commits."""

    node: str
    """This rank's node."""
    scopes: dict[str, tuple[int, ...]]
    """node -> the storage ranks its directory commits (its own and its ring predecessor's)."""

    @property
    def scope(self) -> tuple[int, ...]:
        """The storage ranks this node's directory commits."""
        return self.scopes[self.node]

    def partial(self, world: int) -> list[str]:
        """The nodes whose directory commits only some of the ``world`` storage ranks (every
        node's, from three nodes on: its own ranks' and its ring predecessor's)."""
        return sorted(node for node, scope in self.scopes.items() if len(set(scope)) < world)

    def adopt_line(self, root: str, token: Any) -> None:
        """This node's directory ``root`` commits its scope for the line ``token`` too (that of a
        step agreed on from memory; this node's first rank calls it): a node replaced with an
        empty directory knows only the new run's scope, and without this would neither write its
        predecessor's shards of that step nor send its own to the next node as due for storage."""
        if isinstance(token, str) and read_scope(root, token) is None:
            write_scope(root, token, list(self.scope))

    def flush(self, rank: Flushing, timeout: float | None) -> None:
        """Node-local flush (a persisting rank): this rank's newest in-memory step goes to this
        node's directory and, as a save due for storage, to the next node's (a shard durable here
        is not written again, but sent again: the next node may have been replaced since it got
        the step, or got it as memory only); then waits until this node commits it (its
        predecessor's shards arrive as replicas) and the next node wrote this rank's shard, told by the replica link
        (:class:`flashckpt.replicas._link.Copies`): a copy a node could not write, or a lost
        predecessor, is a :class:`ReplicaError` within seconds; while every peer answers, the
        wait is bounded by ``timeout`` (default ``FLASHCKPT_SAVER_TIMEOUT``)."""
        rank.wait(timeout, copies=False)  # a lost peer's error comes after this rank's newest step went out
        keys = rank.memory_keys()
        if not keys:
            return
        step = max(keys, key=keys.__getitem__)
        storage = rank.storage
        token = rank.memory_info(step).get("token")
        if not storage.newer_than_committed(token, step) and not _committed_by(storage, step, token):
            return  # a newer line's step is committed
        rank.persist(step)  # the saver writes it here (unless durable) and sends it to the next node as due
        rank.wait(timeout, copies=False)
        self.settle(rank.replicas, storage, token, step, timeout)

    def settle(self, replicas: Any, storage: Any, token: str, step: int, timeout: float | None) -> None:
        """Wait, once this rank's persist of ``step`` (line ``token``) is done, until this node
        committed and exported it and the next node wrote this rank's shard (``replicas.copies``:
        :class:`flashckpt.replicas._link.Copies`, see :meth:`flush`); at once where a newer line's
        step is committed here. The wait of a node-local flush and of the engine's ``wait``."""
        if storage.newer_than_committed(token, step) or _committed_by(storage, step, token):
            replicas.copies(storage, token, step, node=self.node, ring=list(self.scopes), scope=self.scope,
                            timeout=timeout).wait()

    def require_replicas(self, endpoints: dict[str, tuple[str, int]], collective: Collective,
                         placement: Placement) -> None:
        """Node-local directories need every node's replica endpoint, and each node's saver able
        to reach the next one's (else its shards would live on that node alone and the next
        node's directory would never commit): a collective call, every rank raises alike."""
        nodes = list(self.scopes)
        missing = sorted(node for node in nodes if node not in endpoints)
        if missing:
            raise CheckpointError(
                f"the checkpoint directory is node-local (not shared between nodes) and peer-memory replicas could "
                f"not start on node(s) {', '.join(missing)} (see their saver logs), so a node's shards would live "
                f"on that node alone; {_REMEDY}")
        unreachable = None
        if placement.local_rank == 0:  # one handshake per node, with its ring successor
            succ = nodes[(nodes.index(self.node) + 1) % len(nodes)]
            try:
                connect_peer(endpoints[succ], placement.secret).close()
            except ReplicaError as exc:
                unreachable = f"node {self.node} cannot reach node {succ}'s: {exc}"
        failed = [why for why in collective.all_gather(unreachable) if why]
        if failed:
            raise CheckpointError(f"the checkpoint directory is node-local (not shared between nodes) and the peer "
                                  f"replica endpoints do not connect ({'; '.join(failed)}); {_REMEDY}")


_LOCAL_TYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs", "f2fs"})
"""File systems of one machine: another node's write never shows there, so there is no cache to wait for."""


def _file_system(path: str) -> str:
    """The type of the file system ``path`` is on (from /proc/self/mountinfo), "" if unknown."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if "-" not in fields:
                    continue
                point = fields[4].encode().decode("unicode_escape")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[fields.index("-") + 1]
    except OSError:
        return ""
    return kind


def _holds(path: str, token: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(token) + 1) == token
    except OSError:
        return False


def _scopes(views: list[tuple]) -> dict[str, tuple[int, ...]]:
    """node -> its persisting storage ranks and its ring predecessor's (nodes ordered by
    their first rank, as the replica ring is)."""
    own: dict[str, set[int]] = {}
    for node, _, _, persists, storage_rank, _ in views:
        own.setdefault(node, set())
        if persists:
            own[node].add(storage_rank)
    nodes = list(own)
    return {node: tuple(sorted(own[node] | own[nodes[i - 1]])) for i, node in enumerate(nodes)}


def _check_not_partly_shared(root: str, views: list[tuple]) -> None:
    """A node-local directory must be one node's alone: nodes that see each other's probes
    there would commit two scopes in one directory (and hold one run lock)."""
    groups = {view[0]: tuple(sorted({views[r][0] for r in view[5]} | {view[0]})) for view in views}
    shared = sorted({group for group in groups.values() if len(group) > 1})
    if shared:
        alone = sorted(node for node, group in groups.items() if len(group) == 1)
        raise CheckpointError(
            f"the checkpoint directory {root} is shared by some nodes but not all: "
            + "; ".join(f"nodes {', '.join(group)} see one directory" for group in shared)
            + (f", node(s) {', '.join(alone)} another" if alone else "")
            + "; give every node the same directory (a shared file system) or each node a directory of its own "
              "(node-local, with peer replicas)")


def check_directory(root: str, collective: Collective, placement: Placement, *,
                    replicas: int | None) -> NodeLocal | None:
    """Whether every rank sees the directory ``root`` rank 0 writes (a collective call).

    Each node's first rank writes a probe with the run's token; each rank looks for them (a
    few seconds on a network file system, for its cache; at once on a local one). Every node
    sees rank 0's: None (a shared directory). Some do not: with replicas on and two or more
    nodes, node-local mode (every rank gets the same :class:`NodeLocal`; each node's first
    rank records its scope in its directory), else a :class:`CheckpointError` on every rank
    naming the nodes that do not see it. Nodes that see each other's probes but not every
    node's (a directory shared by some nodes only) are a :class:`CheckpointError` naming them."""
    c = collective
    token = placement.token.encode()
    firsts = {node: r for r, node in reversed(list(enumerate(placement.nodes)))}  # each node's local rank 0
    probes = {r: os.path.join(root, f".flashckpt-probe-{placement.token}-{r}") for r in sorted(firsts.values())}
    writes = c.rank in probes
    if writes:
        os.makedirs(root, exist_ok=True)
        with open(probes[c.rank], "wb") as f:
            f.write(token)
    c.all_gather(None)  # the probes are written
    # a network file system's cache may show a probe late; a local one shows it now or never
    deadline = time.monotonic() + (0.0 if _file_system(root) in _LOCAL_TYPES else _PROBE_SECONDS)
    while len(sees := [r for r, path in probes.items() if _holds(path, token)]) < len(probes) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    views = c.all_gather((node_id(), 0 in sees, root, placement.persists, placement.storage_rank, sees))
    if writes:
        os.unlink(probes[c.rank])
    blind = sorted({view[0] for view in views if not view[1]})
    if not blind:
        return None
    nodes = list(dict.fromkeys(view[0] for view in views))
    if replicas == 0 or len(nodes) < 2:
        raise CheckpointError(
            f"the checkpoint directory {root} is not shared: the ranks on node(s) {', '.join(blind)} do not see what "
            f"rank 0 (node {views[0][0]}) wrote there, so shards would never commit and those nodes could not load; "
            "give every node the same directory (a shared or network file system mounted at this path), use an "
            "object-store URL, or keep node-local directories with peer replicas (replicas=1, the default on two "
            "or more nodes)")
    _check_not_partly_shared(root, views)
    roots = sorted({view[2] for view in views})
    if len(roots) > 1:
        raise CheckpointError(
            f"node-local checkpoint directories must be at one path on every node (a node writes its ring "
            f"predecessor's replicas into its own directory at that path); the ranks gave {', '.join(roots)}")
    mode = NodeLocal(node=views[c.rank][0], scopes=_scopes(views))
    if placement.local_rank == 0:
        os.makedirs(root, exist_ok=True)
        write_scope(root, placement.token, list(mode.scope))
    log.info("the checkpoint directory %s is node-local (node(s) %s do not share rank 0's): each node commits the "
             "ranks %s of its own and its ring predecessor; peer replicas carry them across nodes", root,
             ", ".join(blind), list(mode.scope))
    return mode
