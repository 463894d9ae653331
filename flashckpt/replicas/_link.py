"""A node-local flush's wait for the other nodes' copies, told by the replica link.

A node-local flush (``flashckpt.replicas._node_local``) is done when this node's directory
committed the step (its ring predecessor's shards arrive as replicas, and this node's saver
writes them; a step whose commit such a write completed is exported there first, see
``flashckpt.saver._node_local``) and the ring successor wrote this rank's shard to its directory. Both happen
in other processes, so the flush asks them over the replica link: each poll is one short
authenticated connection to a saver's endpoint (op ``status``, answered from
:meth:`flashckpt.saver._node_local.ReplicaPersister.status`). The answers end the wait:

- a copy a saver could not write (a full disk, an I/O error) is a :class:`ReplicaError`
  naming the step, the rank and the node, at once;
- a peer whose endpoint does not answer for :data:`LOST_SECONDS` (its saver killed: the
  connection is refused; its node gone or stopped: the handshake times out) is lost, seen
  within a few seconds, not after a fixed wait (one an earlier wait of the run found lost, at
  its first silence: ``wait()`` and then ``close()``'s flush pay the 5 s once): if this
  node's step needed it (its shards), a :class:`ReplicaError` (the caller keeps its memory
  copy); if only its copy of this rank's shard is missing, a warning (this node committed
  the step);
- while every peer answers and nothing failed, the wait goes on as long as it makes
  progress (a copy written, the step committed) at least every :data:`STALL_SECONDS`; past
  that, a warning naming what is missing and the flush returns, as before this module (a
  copy that never comes while its node is alive: e.g. a step the next node's directory does
  not keep for this run); the whole wait is bounded by the flush's ``timeout``
  (:class:`~flashckpt.CheckpointTimeoutError` naming what is missing).

``close()`` asks the same liveness before its agreement with the other ranks
(:func:`silent_nodes`, or the nodes a flush found lost): a collective with a lost node's ranks
would wait for the process group's timeout (a node gone answers no packet), so it is skipped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._errors import CheckpointTimeoutError
from ._protocol import ReplicaError, connect_peer, recv_message, send_message

__all__ = ["LOST_SECONDS", "Copies", "ask_status", "silent_nodes"]

log = logging.getLogger("flashckpt")

Endpoint = tuple[str, int]

LOST_SECONDS = 5.0
"""How long a peer's endpoint may stay silent before the flush takes its node as lost."""
STALL_SECONDS = 20.0
"""How long a flush waits, while every peer answers, without a copy written or the step committed."""
_ASK_SECONDS = 2.5
"""The bound of one status exchange (connect, handshake, answer)."""
_POLL_SECONDS = 0.5

BUSY, WRITTEN, FAILED, UNKEPT = "busy", "written", "failed", "unkept"  # as flashckpt.saver._node_local says them


def ask_status(endpoint: Endpoint, secret: str, want: dict[str, Any],
               timeout: float = _ASK_SECONDS) -> dict[str, list[str]]:
    """Ask the saver at ``endpoint`` how its copies of the ranks in ``want`` (directory,
    token, step, ranks) went: str(rank) -> [state, error]; a ReplicaError when it does not
    answer within ``timeout``."""
    sock = connect_peer(endpoint, secret, timeout)
    try:
        sock.settimeout(timeout)
        send_message(sock, {"op": "status", **want})
        reply = recv_message(sock)
    except OSError as exc:
        raise ReplicaError(f"the replica endpoint {endpoint[0]}:{endpoint[1]} did not answer: {exc}") from exc
    finally:
        sock.close()
    ranks = reply.get("ranks")
    if not reply.get("ok") or not isinstance(ranks, dict):
        raise ReplicaError(f"the replica endpoint {endpoint[0]}:{endpoint[1]} refused a status request: "
                           f"{reply.get('error', reply)}")
    return ranks


def silent_nodes(endpoints: dict[str, Endpoint], secret: str) -> list[str]:
    """The nodes whose replica endpoint does not complete a handshake for :data:`LOST_SECONDS`
    (lost: killed savers refuse, gone nodes stay silent); one handshake each while they answer."""
    pending, began = dict(endpoints), time.monotonic()
    while pending:
        for node, endpoint in list(pending.items()):
            try:
                connect_peer(endpoint, secret, _ASK_SECONDS).close()
                del pending[node]
            except ReplicaError:
                pass
        if not pending or time.monotonic() - began >= LOST_SECONDS:
            break
        time.sleep(_POLL_SECONDS)
    return sorted(pending)


@dataclass(slots=True)
class _Peer:
    """One node's endpoint as a flush polls it: its last answer and since when it is silent."""

    node: str
    endpoint: Endpoint
    ranks: list[int]
    """The ranks whose copies there this flush asks about (none: a liveness probe)."""
    grace: float = LOST_SECONDS
    """How long it may stay silent before it is lost (0: an earlier wait of this run found it lost)."""
    answer: dict[str, list[str]] = field(default_factory=dict)
    silent_since: float | None = None
    why: str = ""

    def poll(self, secret: str, want: dict[str, Any]) -> None:
        began = time.monotonic()
        try:
            self.answer = ask_status(self.endpoint, secret, {**want, "ranks": self.ranks})
            self.silent_since = None
        except ReplicaError as exc:
            self.why = str(exc)
            if self.silent_since is None:
                self.silent_since = began

    def lost(self) -> bool:
        return self.silent_since is not None and time.monotonic() - self.silent_since >= self.grace

    def state(self, rank: int) -> list[str]:
        return self.answer.get(str(rank)) or ["pending", ""]

    def where(self) -> str:
        return f"node {self.node} ({self.endpoint[0]}:{self.endpoint[1]})"


class Storage(Protocol):
    root: str

    def newer_than_committed(self, token: str, step: int) -> bool: ...


class Copies:
    """The copies one persisting rank's node-local flush of ``step`` (run ``token``) waits for.

    ``ring`` lists the nodes in ring order, ``endpoints`` their savers' replica endpoints
    (a node missing there is not asked), ``scope`` the storage ranks this node's directory
    commits; ``bound`` the longest the wait may take while every peer answers; ``lost``
    gets the nodes the wait found lost."""

    def __init__(self, storage: Storage, token: str, step: int, rank: int, *, node: str, ring: list[str],
                 scope: tuple[int, ...], endpoints: dict[str, Endpoint], secret: str, bound: float,
                 lost: set[str] | None = None) -> None:
        self._storage, self._token, self._step, self._rank = storage, token, step, rank
        self._secret, self._bound = secret, bound
        self._lost = set() if lost is None else lost
        self._want = {"directory": storage.root, "token": token, "step": step}
        at = ring.index(node)
        pred, succ = ring[at - 1], ring[(at + 1) % len(ring)]
        self._scope = [r for r in scope if r != rank]
        self._here = self._peer(node, endpoints, self._scope) if len(ring) > 1 else None
        """This node's saver: it writes the predecessor's shards."""
        self._after = self._peer(succ, endpoints, [rank]) if succ != node else None
        """The successor: it writes this rank's shard to its directory."""
        self._before = (self._after if pred == succ else self._peer(pred, endpoints, [])) if pred != node else None
        """The predecessor: this node's commit needs its shards (asked only whether it is alive)."""

    def _peer(self, node: str, endpoints: dict[str, Endpoint], ranks: list[int]) -> _Peer | None:
        """``node``'s saver, if it has an endpoint; one an earlier wait found lost is lost at its
        first silence (not 5 s on again)."""
        if node not in endpoints:
            return None
        return _Peer(node, endpoints[node], ranks, grace=0.0 if node in self._lost else LOST_SECONDS)

    def wait(self) -> None:
        """Until this node committed the step and the successor wrote this rank's shard
        (see the module docstring for what ends the wait otherwise)."""
        bound = self._bound
        deadline = time.monotonic() + bound
        next_poll = 0.0
        progress, last = time.monotonic(), None
        asked_here = False
        while True:
            committed = not self._storage.newer_than_committed(self._token, self._step)
            if committed and not asked_here and self._here is not None:  # a replica's write may have committed it
                self._here.poll(self._secret, self._want)  # and be exporting it: asked once the commit shows
                asked_here = True
            exported = not committed or not self._exporting_here() or (self._here.lost() and self._leave_export())
            confirmed = self._after is None or self._after.state(self._rank)[0] in (WRITTEN, UNKEPT)
            if committed and exported and confirmed:
                return
            if (committed, exported, confirmed) != last:
                progress, last = time.monotonic(), (committed, exported, confirmed)
            elif time.monotonic() - progress > STALL_SECONDS:
                log.warning("flush: after %.0fs without progress, still waiting for %s; the savers answer: "
                            "leaving it to them", STALL_SECONDS, self._missing(committed, exported, confirmed))
                return
            if time.monotonic() >= next_poll:
                asked = {id(p): p for p in ([] if committed else [self._here, self._before])
                         + ([] if exported else [self._here]) + ([] if confirmed else [self._after])
                         if p is not None}
                for peer in asked.values():
                    peer.poll(self._secret, self._want)
                self._raise_failed()
                next_poll = time.monotonic() + _POLL_SECONDS
                if self._gone(committed, confirmed):
                    return
            if time.monotonic() > deadline:
                raise CheckpointTimeoutError(f"flush: after {bound:.0f}s still waiting for "
                                             f"{self._missing(committed, exported, confirmed)} (the savers answer)")
            time.sleep(0.02)

    def _exporting_here(self) -> bool:
        """Whether this node's saver, last asked, was still busy with a predecessor's shard of the
        step: its write committed the step, whose export (a DeepSpeed tag, ...) is running."""
        return self._here is not None and any(self._here.state(r)[0] == BUSY for r in self._scope)

    def _leave_export(self) -> bool:
        """This node's saver went silent after the commit: its export is left to it (a warning)."""
        log.warning("step %d is committed in %s, but this node's saver (%s) has not answered for %.0fs (lost?): "
                    "whether it exported the step is not known: %s", self._step, self._storage.root,
                    self._here.where(), LOST_SECONDS, self._here.why)
        return True

    def _missing(self, committed: bool, exported: bool, confirmed: bool) -> str:
        missing = [] if committed else [f"this node's commit of step {self._step} in {self._storage.root}"]
        if not exported:
            missing.append(f"this node's export of step {self._step} (its saver's, after a replica committed it)")
        if not confirmed:
            missing.append(f"rank {self._rank}'s shard of step {self._step} on {self._after.where()}")
        return " and ".join(missing)

    def _raise_failed(self) -> None:
        for peer, ranks, whose in ((self._after, [self._rank], "this rank's"),
                                   (self._here, self._scope, "the predecessor's")):
            for r in (ranks if peer is not None else []):
                state, error = peer.state(r)
                if state == FAILED:
                    raise ReplicaError(f"step {self._step}: {peer.where()} could not write {whose} shard of rank {r} "
                                       f"to {self._storage.root}: {error}")

    def _gone(self, committed: bool, confirmed: bool) -> bool:
        """Raise (this node cannot commit the step) or True (the successor is lost, the step
        is committed here: a warning) once a peer the wait needs is lost."""
        if not committed:
            for peer, whose in ((self._before, "its ranks' shards"), (self._here, "the predecessor's shards")):
                if peer is not None and peer.lost():
                    self._lost.add(peer.node)
                    raise ReplicaError(
                        f"step {self._step} cannot commit in {self._storage.root}: {peer.where()}, which "
                        f"{'sends' if peer is self._before else 'writes'} {whose}, has not answered for "
                        f"{LOST_SECONDS:.0f}s (lost?): {peer.why}")
        if committed and not confirmed and self._after.lost():
            self._lost.add(self._after.node)
            log.warning("step %d is committed in %s, but %s, which keeps the second copy of rank %d's shard, has "
                        "not answered for %.0fs (lost?): %s", self._step, self._storage.root, self._after.where(),
                        self._rank, LOST_SECONDS, self._after.why)
            return True
        return False
