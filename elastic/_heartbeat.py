"""The agent's heartbeats: which coordinator data sets to heartbeat, for which worker, how often.

A lease of the sharding coordinator lives as long as its worker heartbeats (at least
every ``lease_timeout / 3``). The agent thread calls :meth:`Heartbeats.beat` a few
times a second; each target is heartbeated when due, every ``interval`` seconds. While
training makes no progress past the hang timeout the agent passes ``hung=True`` and
heartbeats are withheld, so a hung worker's leases expire and go back to the queue like
a dead (or SIGSTOPped, or GIL-stuck) one's -- whose agent thread cannot beat at all.

Trade-off: a worker that was only slow (``on_hang="dump"``, and it goes on later)
loses its leases too; the sampler then finds ``LeaseLost`` and those samples may be
trained twice. The adaptive hang timeout (10x p99 step time, 60 s floor by default)
makes that rare.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from elastic._errors import ElasticError

__all__ = ["Heartbeats"]

log = logging.getLogger("elastic.agent")

_ERROR_LOG_SECONDS = 60.0  # a failing coordinator is logged at most once a minute


@dataclasses.dataclass(slots=True, eq=False)
class _Beat:
    """One target: ``target.heartbeat(worker)`` every ``interval`` seconds."""

    target: Any
    worker: str
    interval: float
    due: float = 0.0


class Heartbeats:
    """Heartbeat targets of one agent. ``add``/``remove`` from any thread; ``connect`` and
    ``beat`` from the agent thread only (they may block on the coordinator)."""

    def __init__(self, *, worker: str, max_interval: float, coordinator: Any = None,
                 datasets: tuple[str, ...] = (),
                 on_pause: Callable[[bool, int], None] | None = None) -> None:
        self.worker = worker
        self.max_interval = max_interval
        self._coordinator = coordinator
        self._pending = list(datasets)
        self._on_pause = on_pause
        self._lock = threading.Lock()
        self._beats: list[_Beat] = []
        self.paused = False
        self._error_logged = -_ERROR_LOG_SECONDS
        if coordinator is not None and hasattr(coordinator, "heartbeat"):
            self.add(coordinator)  # a sharding.Dataset given as the coordinator

    def add(self, target: Any, worker: str | None = None, *,
            interval_seconds: float | None = None) -> None:
        interval = self.max_interval
        if interval_seconds is not None:
            if not interval_seconds > 0:
                raise ElasticError(f"interval_seconds must be > 0, got {interval_seconds!r}")
            interval = min(interval, float(interval_seconds))
        worker = worker or self.worker
        with self._lock:
            for beat in self._beats:
                if beat.target is target and beat.worker == worker:
                    beat.interval, beat.due = interval, 0.0
                    return
            self._beats.append(_Beat(target, worker, interval))

    def remove(self, target: Any, worker: str | None = None) -> bool:
        worker = worker or self.worker
        with self._lock:
            kept = [b for b in self._beats if not (b.target is target and b.worker == worker)]
            removed = len(kept) != len(self._beats)
            self._beats = kept
        return removed

    @property
    def coordinator(self) -> Any:
        """What ``coordinator`` was given as: a URL until :meth:`connect` opened it, then the
        Coordinator (or the Dataset, or None)."""
        return self._coordinator

    def targets(self) -> list[tuple[Any, str, float]]:
        """(target, worker, interval) of every registered heartbeat."""
        with self._lock:
            return [(b.target, b.worker, b.interval) for b in self._beats]

    def shortest_interval(self) -> float:
        with self._lock:
            return min((b.interval for b in self._beats), default=self.max_interval)

    def connect(self) -> None:
        """Open the coordinator URL and the named data sets (they may not exist yet:
        retried on the next call)."""
        if isinstance(self._coordinator, str):
            import sharding

            try:
                self._coordinator = sharding.connect(self._coordinator)
            except Exception as err:
                self._log_error("cannot connect to the coordinator: %s", err)
                return
        if self._pending and hasattr(self._coordinator, "dataset"):
            for name in list(self._pending):
                try:
                    self.add(self._coordinator.dataset(name))
                    self._pending.remove(name)
                except Exception as err:
                    log.debug("data set %r not open yet: %s", name, err)

    def beat(self, now: float, *, hung: bool) -> None:
        """Heartbeat the targets that are due, unless training is ``hung``."""
        if hung != self.paused:
            self.paused = hung
            with self._lock:
                count = len(self._beats)
            if count and self._on_pause is not None:
                self._on_pause(hung, count)
        if hung:
            return
        with self._lock:
            due = [b for b in self._beats if now >= b.due]
        for beat in due:
            beat.due = now + beat.interval
            try:
                beat.target.heartbeat(beat.worker)
            except Exception as err:
                self._log_error("heartbeat of %s to %r failed: %s", beat.worker, beat.target, err)

    def _log_error(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._error_logged > _ERROR_LOG_SECONDS:
            self._error_logged = now
            log.warning(fmt, *args)
