"""The saver's persist queue, drained by several threads at once.

Rules, each kept by :meth:`Jobs.take` and :meth:`Jobs.finish`:

- **One rank at a time.** Jobs of one local rank (its slots share a lock file, see
  ``flashckpt._names.lock_path``) run one after another in queue order, never at once:
  a rank's steps reach storage and commit in save order, and its two slots are never
  read together. Jobs of different ranks run on different threads at the same time.
- **Newest steps first.** Fallbacks (older slots a flush writes in case the newest step
  cannot commit, because a peer died mid-save) and the replies queued after them wait
  until no newest-step work is queued or running, so the newest steps of every local
  rank usually commit first and make the fallbacks unnecessary. FIFO within each kind.
- **Replies are barriers.** A reply (``flushed``, ``waited``) is sent once every job
  taken before it has finished, its export included (a job may finish on another
  thread than the one that ran it). Jobs queued after a reply may run before it is sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from .. import _names

__all__ = ["Job", "Jobs", "Replier", "Rescue"]


class Replier(Protocol):
    """The trainer's end of the socket, as a job sees it."""

    def send(self, msg: dict[str, Any]) -> None: ...


class Rescue(NamedTuple):
    """A complete slot a saver writes on a trainer's behalf (it died, or flushes)."""

    slot: str
    generation: int
    info: dict[str, Any]
    step: int
    asked: bool
    """The save asked to be persisted (``SlotHeader.persist_asked``): never a mere fallback."""


@dataclass(eq=False)
class Job:
    slot: str
    generation: int
    client: Replier | None
    info: dict[str, Any] = field(default_factory=dict)
    reply: dict[str, Any] | None = None
    """Message to send once done (for flush/wait); None sends a ``persisted`` note."""
    unless_committed: tuple[dict[str, Any], int] | None = None
    """(info, step): a fallback, skipped if that newer step of the save ``info`` describes
    (its storage and its run's token) is committed (or superseded) by then."""
    later: bool = False
    ticket: int = 0
    """Order in which jobs were taken (replies: how many were taken before them)."""

    @property
    def rank_key(self) -> str:
        return _names.lock_path(self.slot)


class Jobs:
    """The persist queue of one saver (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[Job] = []
        """Waiting jobs: newest-step work first, then fallbacks and replies; FIFO within each."""
        self._running: dict[str, Job] = {}
        """Rank key -> the job reading that rank's slot now."""
        self._unfinished: dict[int, Job] = {}
        """Taken jobs not finished yet (running, or their export pending), by ticket."""
        self._replies: list[Job] = []
        """Replies taken, waiting for the jobs taken before them."""
        self._taken = 0
        self._stopping = False

    def put(self, job: Job, *, later: bool = False) -> None:
        job.later = later
        with self._cond:
            at = len(self._queue) if later else sum(1 for queued in self._queue if not queued.later)
            self._queue.insert(at, job)
            self._cond.notify_all()

    def put_slots(self, slots: list[Rescue], client: Replier | None) -> None:
        """Persist what a dead (or flushing) trainer's slots hold: the newest step and every
        save that asked to be persisted, oldest first; the other older ones as fallbacks
        for the newest, newest first."""
        if not slots:
            return
        newest = max(slots, key=lambda rescue: rescue.step)
        due = sorted((r for r in slots if r.asked or r.step == newest.step), key=lambda rescue: rescue.step)
        for rescue in due:
            self.put(Job(rescue.slot, rescue.generation, client, rescue.info))
        fallback = (newest.info, newest.step)
        for rescue in sorted((r for r in slots if r not in due), key=lambda rescue: -rescue.step):
            self.put(Job(rescue.slot, rescue.generation, client, rescue.info, unless_committed=fallback), later=True)

    def take(self) -> Job | None:
        """The next job this thread may run (blocks); None once :meth:`stop` was called
        and nothing is left to start."""
        while True:
            ready: list[Job] = []
            with self._cond:
                job = self._next(ready)
                if job is None and not ready:
                    if self._stopping and not self._queue:
                        return None
                    self._cond.wait()
                    continue
            _send_replies(ready)  # outside the lock
            if job is not None:
                return job

    def _next(self, ready: list[Job]) -> Job | None:
        """Take the first job that may run now (caller holds the lock); replies at the
        head are taken on the way and those already due are added to ``ready``."""
        while self._queue and self._queue[0].reply is not None:
            reply = self._queue.pop(0)
            reply.ticket = self._taken
            self._replies.append(reply)
        ready.extend(self._due_replies())
        newest_pending = any(not job.later for job in self._running.values())
        blocked: set[str] = set()
        for i, job in enumerate(self._queue):
            if job.reply is not None:
                continue
            key = job.rank_key
            if key in self._running or key in blocked or (job.later and newest_pending):
                blocked.add(key)
                newest_pending = newest_pending or not job.later
                continue
            del self._queue[i]
            self._taken += 1
            job.ticket = self._taken
            self._running[key] = job
            self._unfinished[job.ticket] = job
            return job
        return None

    def _due_replies(self) -> list[Job]:
        """Replies whose jobs taken before them all finished, removed (caller holds the lock)."""
        first = min(self._unfinished, default=None)
        due = [reply for reply in self._replies if first is None or first > reply.ticket]
        self._replies = [reply for reply in self._replies if reply not in due]
        return due

    def release(self, job: Job) -> None:
        """``job`` no longer reads its slot: the next job of its rank may start (its export
        may still run; :meth:`finish` follows)."""
        with self._cond:
            self._release(job)
            self._cond.notify_all()

    def _release(self, job: Job) -> None:
        if self._running.get(job.rank_key) is job:
            del self._running[job.rank_key]

    def finish(self, job: Job) -> None:
        """``job`` is done, its outcome sent: replies waiting for it go out."""
        with self._cond:
            self._release(job)
            self._unfinished.pop(job.ticket, None)
            ready = self._due_replies()
            self._cond.notify_all()
        _send_replies(ready)

    def idle(self) -> bool:
        """Nothing queued, running, exporting or waiting to reply."""
        with self._cond:
            return not (self._queue or self._unfinished or self._replies)

    def stop(self) -> None:
        """Let :meth:`take` return None once nothing is left to start."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


def _send_replies(replies: list[Job]) -> None:
    for reply in replies:
        reply.client.send(reply.reply)
