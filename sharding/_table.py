"""Lease bookkeeping for one data set as plain Python data, used by the memory and SQLite
stores (the Redis store does the same transitions in Lua; a shared test checks that every
backend gives the same answers for the same calls).

Everything is a pure transition on a :class:`LeaseTable` plus an explicit ``now``; the
table round-trips through JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ._store import Ask, Grant, Lease, Status, Wait

__all__ = ["LeaseTable"]


@dataclass(slots=True)
class _Lease:
    worker: str
    token: int
    consumed: int
    deadline: float
    #: the step ``consumed`` was reported at (-1: as handed out, or reported without one)
    step: int = -1
    #: [step, consumed] of the report before, at another step (None: none since handed out)
    before: list[int] | None = None


@dataclass(slots=True)
class LeaseTable:
    """The lease state of one data set."""

    epoch: int = 0
    cursor: int = 0
    next_token: int = 0
    #: returned positions, front of the queue first: [slot, consumed]
    queue: list[list[int]] = field(default_factory=list)
    leases: dict[int, _Lease] = field(default_factory=dict)
    #: worker -> [acquired, completed]
    workers: dict[str, list[int]] = field(default_factory=dict)
    #: shards completed with a step, which a read as of an earlier step still holds: "epoch:slot"
    #: -> [epoch, step, the lease's last reported step, consumed then, its ``before``] (see :meth:`complete`)
    completed_at: dict[str, list[Any]] = field(default_factory=dict)

    # -- transitions -------------------------------------------------------------

    def acquire(
        self, worker: str, now: float, *, lease_timeout: float, num_shards: int, num_epochs: int | None
    ) -> Grant | Wait | None:
        expired = sorted((lease.deadline, slot) for slot, lease in self.leases.items() if lease.deadline <= now)
        self.queue[:0] = [[slot, self._drop(slot).consumed] for _, slot in expired]
        if self.queue:
            slot, consumed = self.queue.pop(0)
        elif self.cursor < num_shards:
            slot, consumed = self.cursor, 0
            self.cursor += 1
        elif self.leases:
            return Wait(max(0.0, min(lease.deadline for lease in self.leases.values()) - now))
        elif num_epochs is not None and self.epoch + 1 >= num_epochs:
            return None
        else:
            self.epoch, self.cursor = self.epoch + 1, 1
            slot, consumed = 0, 0
        self.next_token += 1
        self.leases[slot] = _Lease(worker, self.next_token, consumed, now + lease_timeout)
        self.workers.setdefault(worker, [0, 0])[0] += 1
        return Grant(self.epoch, slot, consumed, self.next_token)

    def report(
        self, epoch: int, slot: int, token: int, consumed: int, now: float, *, lease_timeout: float,
        step: int | None = None,
    ) -> tuple[Status, str | None]:
        status = self._check(epoch, slot, token)
        if status[0] is Status.OK:
            lease = self.leases[slot]
            if step is not None and self.completed_at:
                self._forget_completions(step)
            if step is None:
                lease.step, lease.before = -1, None
            elif step != lease.step:
                lease.step, lease.before = step, [lease.step, lease.consumed]
            lease.consumed, lease.deadline = consumed, now + lease_timeout
        return status

    def complete(self, epoch: int, slot: int, token: int, step: int | None = None) -> tuple[Status, str | None]:
        """With ``step``: the shard was consumed whole at that step; its last reported positions
        (what ``as_of`` reads of earlier steps take, as of a held lease) stay in ``completed_at``."""
        status = self._check(epoch, slot, token)
        if status[0] is Status.OK:
            lease = self._drop(slot)
            self.workers.setdefault(lease.worker, [0, 0])[1] += 1
            if step is not None:
                self.completed_at[f"{epoch}:{slot}"] = [epoch, step, lease.step, lease.consumed, lease.before]
        return status

    def complete_and_acquire(
        self, done: Sequence[Lease], now: float, ask: Ask
    ) -> tuple[list[tuple[Status, str | None]], list[Grant | Wait | None]]:
        statuses = [self.complete(epoch, slot, token) for epoch, slot, token in done]
        answers: list[Grant | Wait | None] = []
        if all(status is Status.OK for status, _ in statuses):
            while len(answers) < ask.count and (not answers or isinstance(answers[-1], Grant)):
                answers.append(self.acquire(ask.worker, now, lease_timeout=ask.lease_timeout,
                                            num_shards=ask.num_shards, num_epochs=ask.num_epochs))
        return statuses, answers

    def heartbeat(self, worker: str, now: float, *, lease_timeout: float) -> int:
        self.workers.setdefault(worker, [0, 0])
        mine = [lease for lease in self.leases.values() if lease.worker == worker]
        for lease in mine:
            lease.deadline = now + lease_timeout
        return len(mine)

    def release(self, worker: str) -> int | None:
        if worker not in self.workers:
            return None
        mine = sorted(slot for slot, lease in self.leases.items() if lease.worker == worker)
        self.queue[:0] = [[slot, self._drop(slot).consumed] for slot in mine]
        return len(mine)

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.queue = [[int(s), int(c)] for s, c in state["queue"]]
        self.leases = {}
        self.completed_at = {}
        self.workers = {str(w): [int(a), int(c)] for w, (a, c) in state["workers"].items()}

    # -- helpers -----------------------------------------------------------------

    def _drop(self, slot: int) -> _Lease:
        return self.leases.pop(slot)

    def _forget_completions(self, step: int) -> None:
        """A holder reports ``step`` (at a boundary or as its update begins): lock-step ranks
        are all past step ``step``'s gradients, so no read is as of a step before ``step - 1``,
        and no completion is tagged beyond ``step + 2`` (an entry past that is of an earlier run
        whose steps counted higher)."""
        self.completed_at = {key: entry for key, entry in self.completed_at.items() if step <= entry[1] <= step + 2}

    def _check(self, epoch: int, slot: int, token: int) -> tuple[Status, str | None]:
        if epoch < self.epoch:
            return Status.DONE, None
        if epoch > self.epoch:
            return Status.UNKNOWN, None
        lease = self.leases.get(slot)
        if lease is not None:
            return (Status.OK, lease.worker) if lease.token == token else (Status.HELD, lease.worker)
        if any(entry[0] == slot for entry in self.queue):
            return Status.RETURNED, None
        return (Status.DONE, None) if slot < self.cursor else (Status.UNKNOWN, None)

    # -- JSON --------------------------------------------------------------------

    def to_json(self, now: float) -> dict[str, Any]:
        """State as JSON; lease deadlines become ``expires_in`` seconds from ``now``."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "next_token": self.next_token,
            "queue": [list(entry) for entry in self.queue],
            "leases": {
                str(slot): {
                    "worker": lease.worker,
                    "token": lease.token,
                    "consumed": lease.consumed,
                    "expires_in": lease.deadline - now,
                    "step": lease.step,
                    "before": None if lease.before is None else list(lease.before),
                }
                for slot, lease in sorted(self.leases.items())
            },
            "workers": {w: list(counts) for w, counts in self.workers.items()},
            "completed_at": {key: [*entry[:4], None if entry[4] is None else list(entry[4])]
                             for key, entry in sorted(self.completed_at.items())},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], now: float) -> "LeaseTable":
        """Inverse of :meth:`to_json`."""
        table = cls(epoch=data["epoch"], cursor=data["cursor"], next_token=data["next_token"])
        table.queue = [list(entry) for entry in data["queue"]]
        table.leases = {
            int(slot): _Lease(v["worker"], v["token"], v["consumed"], now + v["expires_in"], v.get("step", -1),
                              v.get("before"))
            for slot, v in data["leases"].items()
        }
        table.workers = {w: list(c) for w, c in data["workers"].items()}
        table.completed_at = {key: list(entry) for key, entry in data.get("completed_at", {}).items()}
        return table
