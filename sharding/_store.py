"""The storage protocol: the few atomic operations a backend supplies.

A store keeps, per data set, its definition and its lease state: the epoch, a cursor
into the epoch's shard order, a queue of returned positions (front first), the leases
(position -> worker, token, consumed, deadline) and per-worker counters. Positions
("slots") index the epoch's shard order; mapping a slot to a shard, and everything
else about shards, lives in the coordinator, written once.

Each operation is atomic. Status codes (:class:`Status`) tell the coordinator what
happened; it turns them into exceptions with messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Sequence

__all__ = ["Ask", "Event", "Grant", "Lease", "Status", "Store", "Wait"]

#: a lease as the store knows it: (epoch, slot, token)
Lease = tuple[int, int, int]
#: an event as a store keeps it: (seq, time or None, source, kind, payload as JSON text)
Event = tuple[int, float | None, str, str, str]


class Status(str, enum.Enum):
    """Outcome of an operation on a lease."""

    OK = "ok"
    #: the lease is held by another token (expired, then re-leased)
    HELD = "held"
    #: the lease expired or was released, and its shard waits in the queue
    RETURNED = "returned"
    #: the shard is already completed in that epoch
    DONE = "done"
    #: the slot was never handed out in that epoch
    UNKNOWN = "unknown"
    #: the worker never acquired nor heartbeated
    UNKNOWN_WORKER = "unknown_worker"


class Grant(NamedTuple):
    """A lease handed out by :meth:`Store.acquire` (a tuple: cheap on the hot path)."""

    epoch: int
    slot: int
    consumed: int
    token: int


class Ask(NamedTuple):
    """What an acquire inside :meth:`Store.complete_and_acquire` asks for."""

    worker: str
    lease_timeout: float
    num_shards: int
    num_epochs: int | None
    #: grants wanted: acquiring stops at the first answer that is not a grant
    count: int = 1


@dataclass(frozen=True, slots=True)
class Wait:
    """No shard now, but leases are out; ``seconds`` until the earliest could expire."""

    seconds: float


class Store(Protocol):
    """Atomic storage operations for lease bookkeeping (one implementation per backend)."""

    def define(self, name: str, definition: str | None) -> str | None:
        """Store ``definition`` if ``name`` is new; return the stored one (None if absent)."""

    def complete_and_acquire(
        self, name: str, *, done: Sequence[Lease], ask: Ask
    ) -> tuple[list[tuple[Status, str | None]], list[Grant | Wait | None]]:
        """:meth:`complete` each lease of ``done`` in order, then, only if every one gave
        OK, acquire for ``ask.worker`` up to ``ask.count`` times, stopping after the first
        answer that is not a grant; one atomic operation (``done=()``: an acquire alone).
        An acquire reclaims expired leases to the queue front, then leases the queue front
        or the next slot, advancing the epoch when the last one is done; its answer is None
        when all epochs are done. Returns each completion's (status, holder) and the
        acquires' answers (none when a completion was refused)."""

    def report(
        self, name: str, *, epoch: int, slot: int, token: int, consumed: int, lease_timeout: float,
        step: int | None = None,
    ) -> tuple[Status, str | None]:
        """Record the position inside a held lease and extend it; the holder on HELD. With
        ``step``, the position is that of this step, and the lease keeps the last one of an
        earlier step beside it (``snapshot``'s ``step`` and ``before``); without, it has none."""

    def complete(
        self, name: str, *, epoch: int, slot: int, token: int, step: int | None = None
    ) -> tuple[Status, str | None]:
        """Finish a held lease; the holder on HELD. With ``step``, the shard was consumed
        whole at that step, and its last reported positions stay readable (``snapshot``'s
        ``completed_at``) until a report two steps later."""

    def heartbeat(self, name: str, worker: str, *, lease_timeout: float) -> int:
        """Extend all of ``worker``'s leases (registering the worker); return how many."""

    def release(self, name: str, worker: str) -> int | None:
        """Return all of ``worker``'s leases to the queue front; None for an unknown worker."""

    def snapshot(self, name: str) -> dict[str, Any]:
        """A consistent copy of the lease state (see ``_table.LeaseTable.to_json``)."""

    def restore(self, name: str, state: dict[str, Any]) -> None:
        """Replace the lease state: no leases, the given queue, cursor, epoch and counters."""

    def publish(self, kind: str, source: str, payload: str, *, keep: int) -> int:
        """Append an event (``payload`` is JSON text) to the job-wide log under the next
        sequence number, drop all but the newest ``keep``; return its sequence number."""

    def events(self, since: int, limit: int | None) -> list[Event]:
        """Events with ``seq > since``, oldest first, at most ``limit``."""

    def close(self) -> None:
        """Release connections."""
