"""The engine's side of peer-memory replicas (see ``flashckpt.replicas._protocol`` for the design).

At construction (a collective call) every rank hands its node's saver the run's secret,
the ranks gather each node's replica endpoint, and each saver is told to push to the next
node of the ring. At load, each node's local rank 0 reports the replicas its node holds,
the agreement counts them as copies, and a rank whose node lacks the agreed step writes it
into its own slot from a peer's replica (checksum verified) before loading from memory as
usual; any failure falls back to storage with a warning.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Protocol

from .._errors import CheckpointError
from .._placement import Collective, Placement
from ._link import Copies, silent_nodes
from ._protocol import ReplicaError, advertised_host, fetch
from ._store import replica_index
from ..memory._rank_slots import RankSlots, Saver, Writer
from ..restore._ranks import gather, raise_errors
from ..saver._settings import saver_timeout
from ..storage._step_meta import line_key

__all__ = ["PeerReplicas", "ReplicaSaver"]

log = logging.getLogger("flashckpt")

ADDR_ENV = "FLASHCKPT_REPLICA_ADDR"
"""The address this node's saver takes replicas on (default: the one that reaches MASTER_ADDR)."""

Endpoint = tuple[str, int]


class ReplicaSaver(Saver, Protocol):
    """What replicas need of the node's saver (``flashckpt.saver._client.SaverClient``)."""

    def replicate(self, secret: str, bind: str, advertise: str) -> Endpoint: ...

    def replica_peer(self, peer: Endpoint) -> None: ...


class PeerReplicas:
    """One rank's peer-memory replicas: the nodes' endpoints, and fetching at load.

    ``info`` gives what a copy written into this rank's ``slots`` records (the engine's
    directory, ranks and line); ``replicas`` is :attr:`flashckpt.Options.replicas`."""

    def __init__(self, collective: Collective, placement: Placement, saver: ReplicaSaver, slots: RankSlots, *,
                 directory: str, replicas: int | None, info: Callable[[], dict[str, Any]]) -> None:
        self._collective, self._placement, self._saver, self._slots = collective, placement, saver, slots
        self._directory, self._info = directory, info
        self.endpoints: dict[str, Endpoint] = self._start(replicas)
        """node -> its saver's replica endpoint; empty when replicas are off."""
        self.lost: set[str] = set()
        """The nodes a node-local flush found lost (their savers silent on the replica link)."""

    def _start(self, replicas: int | None) -> dict[str, Endpoint]:
        """Peer-memory replicas on a ring (a collective call, when the job spans two or more
        nodes and ``replicas`` is not 0): every rank hands its saver the run's secret and
        learns its endpoint, the ranks gather each node's endpoint, and each saver is told to
        push to the next node (nodes in the order of their first rank)."""
        p, rank = self._placement, self._collective.rank
        nodes = list(dict.fromkeys(p.nodes))
        if replicas == 0 or len(nodes) < 2 or not p.secret:
            return {}
        chosen = os.environ.get(ADDR_ENV)
        bind, advertise = (chosen, chosen) if chosen else advertised_host(os.environ.get("MASTER_ADDR"))
        try:
            mine: Endpoint | None = self._saver.replicate(p.secret, bind, advertise)
        except CheckpointError as exc:
            log.warning("peer-memory replicas are off on this node: %s", exc)
            mine = None
        endpoints: dict[str, Endpoint] = {}
        for node, endpoint in self._collective.all_gather((p.nodes[rank], mine)):
            if endpoint is not None:
                endpoints.setdefault(node, (str(endpoint[0]), int(endpoint[1])))
        peer = endpoints.get(nodes[(nodes.index(p.nodes[rank]) + 1) % len(nodes)])
        if mine is not None and peer is not None:
            self._saver.replica_peer(peer)
        return endpoints

    def lost_nodes(self) -> list[str]:
        """The other nodes whose savers do not answer on the replica link: those a flush found
        lost, else those silent now for ``LOST_SECONDS`` (one handshake each while they
        answer; [] with replicas off). A collective with a lost node waits for the process
        group's timeout, so ``close()`` skips its agreement then."""
        if self.lost:
            return sorted(self.lost)
        me = self._placement.nodes[self._collective.rank] if self._placement.nodes else None
        return silent_nodes({n: e for n, e in self.endpoints.items() if n != me}, self._placement.secret)

    def here(self) -> list[tuple[int, int, tuple[str, int]]]:
        """(storage rank, step, (line, step)) of the complete replicas of this run's directory
        that this node keeps for other nodes' ranks (reported by local rank 0 only)."""
        p = self._placement
        if not self.endpoints or p.local_rank != 0:
            return []
        return [(h.info.get("storage_rank"), h.step, (line_key(h.info.get("token")), h.step))
                for _, h in replica_index(self._slots.job_id)
                if h.info.get("directory") == self._directory and h.info.get("storage_world") == p.storage_world]

    def holders(self, views: list[dict[str, Any]]) -> dict[tuple[int, int], list[Endpoint]]:
        """From every rank's load view: (storage rank, step) -> endpoints of the nodes that
        hold its replica."""
        nodes = self._placement.nodes
        holders: dict[tuple[int, int], list[Endpoint]] = {}
        for rank, view in enumerate(views):
            endpoint = self.endpoints.get(nodes[rank]) if nodes else None
            for storage_rank, step, _ in view["replicas"]:
                if endpoint is not None:
                    holders.setdefault((storage_rank, step), []).append(endpoint)
        return holders

    def fetch_missing(self, step: int, holders: dict[tuple[int, int], list[Endpoint]],
                      committed: int | None) -> tuple[int | None, str]:
        """Ranks whose node lacks ``step`` in memory write it into their slot from a peer's
        replica (a collective call). If that fails on any rank, (committed, "storage") with a
        warning; else (step, "memory")."""
        p = self._placement
        need = p.writes_memory and step not in self._slots.steps()
        _, errors = gather(self._collective,
                           lambda: self._fetch(step, holders.get((p.storage_rank, step), [])) if need else None)
        if not errors:
            return step, "memory"
        if committed is None:
            raise_errors(errors, f"restoring step {step} from peer replicas failed and nothing is committed "
                                 f"in {self._directory}")
        log.warning("restoring step %d from peer replicas failed on some ranks (%s); falling back to committed "
                    "step %d", step, "; ".join(m for _, m in errors), committed)
        return committed, "storage"

    def _fetch(self, step: int, endpoints: list[Endpoint]) -> None:
        """Write this rank's replica of ``step`` into one of its slots from the first peer
        that sends one whose checksum verifies."""
        rank = self._placement.storage_rank
        failures = []
        for endpoint in endpoints:
            try:
                self.fetch_from(endpoint, step)
                log.info("fetched step %d of rank %d from the replica on %s:%d", step, rank, *endpoint)
                return
            except (CheckpointError, OSError) as exc:
                failures.append(f"{endpoint[0]}:{endpoint[1]}: {exc}")
        raise ReplicaError(f"no peer sent a verified replica of step {step} rank {rank}"
                           f"{': ' + '; '.join(failures) if failures else ' (none holds one)'}")

    def fetch_from(self, endpoint: Endpoint, step: int, op: str = "fetch", **want: Any) -> None:
        """Write this rank's copy of ``step`` into one of its slots from the peer at ``endpoint``
        (``op`` "fetch": its memory replica; "fetch_shard": its node-local directory)."""
        p = self._placement
        into, done = self.slot_writer(step)

        def check(header: dict[str, Any]) -> memoryview:
            size, info = header.get("image_len"), header.get("info")
            if header.get("step") != step or not isinstance(size, int) or not isinstance(info, dict):
                raise ReplicaError(f"{endpoint[0]}:{endpoint[1]} answered with step {header.get('step')!r}, "
                                   f"not {step}")
            return into(size, info)

        fetch(endpoint, p.secret, {"directory": self._directory, "storage_rank": p.storage_rank,
                                   "storage_world": p.storage_world, "step": step, **want}, check, op=op)
        done()

    def copies(self, storage: Any, token: str, step: int, *, node: str, ring: list[str], scope: tuple[int, ...],
               timeout: float | None) -> Copies:
        """What a node-local flush of ``step`` waits for (:class:`flashckpt.replicas._link.Copies`),
        bounded by ``timeout`` (default ``FLASHCKPT_SAVER_TIMEOUT``) while every peer answers."""
        p = self._placement
        return Copies(storage, token, step, p.storage_rank, node=node, ring=ring, scope=scope,
                      endpoints=self.endpoints, secret=p.secret,
                      bound=saver_timeout() if timeout is None else timeout, lost=self.lost)

    def slot_writer(self, step: int) -> Writer:
        """Where a copy of ``step`` for this rank goes (:meth:`flashckpt.memory._rank_slots.RankSlots.writer`)."""
        return self._slots.writer(step, self._info(), self._saver, saver_timeout())
