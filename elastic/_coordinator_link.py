"""The agent's link to the sharding coordinator, and the thread that does its blocking I/O.

The coordinator thread (``elastic-agent-coordinator``) opens the coordinator URL and the
named data sets (retried until they exist), drives the process's heartbeat schedule
(``elastic._heartbeat``: withheld while training is hung) and publishes the events queued
since (``elastic._publish``) to the coordinator's job-wide log. Its calls may block for
the coordinator's whole retry budget while it is unreachable, which is why they are not
the watch thread's (an unreachable coordinator cannot delay finding a hang).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from elastic._heartbeat import Heartbeats
from elastic._publish import EventPublisher, as_record, coordinator_of
from elastic._ratelog import RateLimitedLog

__all__ = ["CoordinatorLink", "publishes"]

log = logging.getLogger("elastic.agent")

#: how long a process about to exit waits for its last events to reach the coordinator
EXIT_PUBLISH_SECONDS = 3.0


def publishes(coordinator: Any) -> bool:
    """A URL, a Coordinator or a Dataset (through its coordinator) gets the events."""
    return isinstance(coordinator, str) or coordinator_of(coordinator) is not None


class CoordinatorLink:
    """What the agent was given as ``coordinator`` (a URL until the thread connected it,
    then the Coordinator; or a Coordinator, a Dataset, None), its ``datasets`` to
    heartbeat, and the events to publish there."""

    def __init__(self, coordinator: Any, *, worker: str, owner: Any, heartbeats: Heartbeats,
                 publisher: EventPublisher, datasets: tuple[str, ...] = (),
                 interval: float) -> None:
        self.coordinator = coordinator
        self._worker = worker
        self._owner = owner
        self._heartbeats = heartbeats
        self._publisher = publisher
        self._pending = list(datasets)  # names, opened by connect()
        # a sharding.Dataset given as the coordinator: heartbeated from the first connect()
        self._opened = [coordinator] if hasattr(coordinator, "heartbeat") else []
        self._interval = interval
        self._reader: Any = None  # a Coordinator opened by events() before the thread did
        self._errors = RateLimitedLog(log)

    def run(self, stop: threading.Event, hung: Callable[[float], bool]) -> None:
        """The coordinator thread's loop, until ``stop``: connect, heartbeat (not while
        ``hung(now)``), publish."""
        next_connect = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_connect:
                    next_connect = now + self._interval
                    self.connect()
                self._heartbeats.beat(now, hung=hung(now))
                self._publisher.publish(self.coordinator)
            except Exception:  # the agent must never die of its own bug
                log.exception("elastic agent coordinator iteration failed")
            stop.wait(min(0.5, self._interval, self._heartbeats.shortest_interval(self._interval)))

    def connect(self) -> None:
        """Open the coordinator URL and the named data sets (they may not exist yet:
        retried on the next call); heartbeat the data sets from now on."""
        if isinstance(self.coordinator, str):
            import sharding

            try:
                self.coordinator = sharding.connect(self.coordinator)
            except Exception as err:
                self._errors.warning("cannot connect to the coordinator: %s", err)
                return
        if self._pending and hasattr(self.coordinator, "dataset"):
            for name in list(self._pending):
                try:
                    self._opened.append(self.coordinator.dataset(name))
                    self._pending.remove(name)
                except Exception as err:
                    log.debug("data set %r not open yet: %s", name, err)
        for dataset in self._opened:
            self._heartbeats.add(dataset, self._worker, interval_seconds=self._interval, owner=self._owner)
        self._opened = []

    def events(self) -> list[dict[str, Any]] | None:
        """Every rank's events from the coordinator's log, plus this process's own not
        published yet; None when there is no coordinator log or it cannot be read (logged)."""
        target = coordinator_of(self.coordinator)
        if target is None and isinstance(self.coordinator, str):  # the thread has not connected yet
            if self._reader is None:
                import sharding

                try:
                    self._reader = sharding.connect(self.coordinator)
                except Exception as err:
                    log.warning("events: cannot connect to the coordinator: %s", err)
                    return None
            target = self._reader
        if target is None:
            return None
        try:
            remote = [as_record(e) for e in target.events()]
        except Exception as err:
            log.warning("events: cannot read the coordinator's event log: %s", err)
            return None
        seen = {_event_key(r) for r in remote}
        remote += [r for r in self._publisher.pending() if _event_key(r) not in seen]
        return sorted(remote, key=lambda r: r.get("time") or 0.0)

    def publish_before_exit(self) -> None:
        """Give the queued events a last, bounded, try."""
        try:
            self._publisher.flush(self.coordinator, timeout=EXIT_PUBLISH_SECONDS)
        except Exception:  # the agent must never die of its own bug
            log.exception("elastic agent: publishing the last events failed")



def _event_key(record: dict[str, Any]) -> tuple:
    return (record.get("worker"), record.get("pid"), record.get("type"), record.get("time"))
