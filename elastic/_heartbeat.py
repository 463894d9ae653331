"""One heartbeat path per process: every lease heartbeat goes through one schedule.

A lease of the sharding coordinator lives as long as its worker heartbeats (at least
every ``lease_timeout / 3``). The agent's own targets (``start_agent(coordinator=
dataset)``, ``datasets=``, :meth:`Agent.add_heartbeat`), a ``ShardSampler``'s leases and
a TF ``ShardPositions``' leases are all entries of :func:`process_heartbeats`, heartbeated
when due by exactly one thread of the process:

- while an agent runs, its coordinator thread (``elastic._coordinator_link``) attaches
  and drives the schedule: it withholds every heartbeat while training makes no progress
  past the hang timeout, so a hung worker's leases expire and go back to the queue like
  a dead (or SIGSTOPped, or GIL-stuck) one's, and no interval is longer than the agent's
  ``heartbeat_interval``;
- without an agent, a daemon thread of this module (``shard-heartbeat-<worker>``, named
  after the worker that started it) drives it; it ends once no entry is left or an
  agent attaches, and starts again when an agent detaches with entries left.

An entry lives until it is removed, or until its owner (the sampler, positions or agent
that added it) is garbage collected. Trade-offs: one thread beats every target in turn,
so a coordinator that blocks delays the others' beats (as the agent's thread always
did); a worker that was only slow (``on_hang="dump"``, and it goes on later) loses its
leases too -- the adaptive hang timeout (10x p99 step time, 60 s floor) makes that rare.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from elastic._errors import ElasticError
from elastic._ratelog import RateLimitedLog

__all__ = ["Heartbeats", "process_heartbeats"]

log = logging.getLogger("elastic.agent")



@dataclasses.dataclass(slots=True, eq=False)
class _Beat:
    """One target: ``target.heartbeat(worker)`` every ``interval`` seconds, while ``owner``
    lives."""

    target: Any
    worker: str
    interval: float
    owner: "weakref.ref[Any]"
    due: float = 0.0


class Heartbeats:
    """The heartbeat schedule of this process (use :func:`process_heartbeats`).

    ``add``/``remove`` from any thread; ``beat`` from the thread that drives the
    schedule only: the attached agent's coordinator thread, else this schedule's own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beats: list[_Beat] = []
        self._driver: Any = None  # the attached agent
        self._max_interval: float | None = None
        self._on_pause: Callable[[bool, int], None] | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self.paused = False
        self._errors = RateLimitedLog(log)

    def add(self, target: Any, worker: str, *, interval_seconds: float, owner: Any) -> None:
        """Heartbeat ``target`` (anything with ``.heartbeat(worker)``) for ``worker`` every
        ``interval_seconds``, starting at once, while ``owner`` lives. Adding the same
        (target, worker) again takes the new owner; a new interval starts at once (the
        same one keeps its schedule, so adding on every lease costs no extra beat)."""
        if not interval_seconds > 0:
            raise ElasticError(f"interval_seconds must be > 0, got {interval_seconds!r}")
        with self._lock:
            for beat in self._beats:
                if beat.target is target and beat.worker == worker:
                    beat.owner = weakref.ref(owner)
                    if beat.interval != interval_seconds:
                        beat.interval, beat.due = float(interval_seconds), 0.0
                    break
            else:
                self._beats.append(_Beat(target, worker, float(interval_seconds), weakref.ref(owner)))
            self._ensure_thread(worker)
        self._wake.set()

    def remove(self, target: Any, worker: str) -> bool:
        """Stop heartbeating ``target`` for ``worker``; False if it was not registered."""
        with self._lock:
            kept = [b for b in self._beats if not (b.target is target and b.worker == worker)]
            removed = len(kept) != len(self._beats)
            self._beats = kept
        return removed

    def targets(self) -> list[tuple[Any, str, float]]:
        """(target, worker, interval) of every live entry, with the interval it is sent at."""
        with self._lock:
            return [(b.target, b.worker, self._interval(b)) for b in self._live()]

    def shortest_interval(self, default: float) -> float:
        with self._lock:
            return min((self._interval(b) for b in self._live()), default=default)

    # -- the agent ------------------------------------------------------------------------
    def attach(self, agent: Any, *, max_interval: float,
               on_pause: Callable[[bool, int], None] | None = None) -> None:
        """``agent``'s coordinator thread drives the schedule from now on (this module's
        thread ends); intervals are capped at ``max_interval``."""
        with self._lock:
            self._driver, self._max_interval, self._on_pause = agent, max_interval, on_pause
            self.paused = False
        self._wake.set()

    def detach(self, agent: Any) -> None:
        """``agent`` stops: its own entries go, and this module's thread takes the rest."""
        with self._lock:
            if self._driver is not agent:
                return
            self._driver, self._max_interval, self._on_pause = None, None, None
            self._beats = [b for b in self._beats if b.owner() is not agent]
            self.paused = False
            worker = self._beats[0].worker if self._beats else None
            if worker is not None:
                self._ensure_thread(worker)

    # -- sending --------------------------------------------------------------------------
    def beat(self, now: float, *, hung: bool = False) -> None:
        """Heartbeat the entries that are due, unless training is ``hung``."""
        with self._lock:
            self._beats = self._live()
            count, on_pause = len(self._beats), self._on_pause
        if hung != self.paused:
            self.paused = hung
            if count and on_pause is not None:
                on_pause(hung, count)
        if hung:
            return
        with self._lock:
            due = [b for b in self._beats if now >= b.due]
            for beat in due:
                beat.due = now + self._interval(beat)
        for beat in due:
            try:
                beat.target.heartbeat(beat.worker)
            except Exception as err:  # keep trying: the next beat may still save the lease
                self._errors.warning("heartbeat of %s to %r failed: %s", beat.worker, beat.target, err)

    def _live(self) -> list[_Beat]:
        return [b for b in self._beats if b.owner() is not None]

    def _interval(self, beat: _Beat) -> float:
        return beat.interval if self._max_interval is None else min(beat.interval, self._max_interval)

    def _ensure_thread(self, worker: str) -> None:
        """Start this module's thread when nobody drives the schedule (lock held)."""
        if self._driver is not None or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._run, name=f"shard-heartbeat-{worker}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """This module's thread: drives the schedule while no agent does and entries remain."""
        while True:
            with self._lock:
                if self._driver is not None or not self._live():
                    self._thread = None
                    return
            self._wake.clear()
            self.beat(time.monotonic())
            with self._lock:
                due = min((b.due for b in self._beats), default=time.monotonic())
            self._wake.wait(max(0.0, due - time.monotonic()))



_process: Heartbeats | None = None
_process_lock = threading.Lock()


def process_heartbeats() -> Heartbeats:
    """This process's heartbeat schedule (a forked child gets a new, empty one)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = Heartbeats()
        return _process


def _forget_after_fork() -> None:
    global _process, _process_lock
    _process, _process_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
