"""The agent's events in the coordinator's job-wide log, so every rank sees every rank's.

Any thread queues an event (:meth:`EventPublisher.put`: a short lock and a deque
append, never I/O); the agent thread publishes the queue to the coordinator
(``sharding.Coordinator.publish``) on each of its iterations, and a process about to
exit gives the queue a last, bounded, try (:meth:`EventPublisher.flush`). A failed
publish is logged (at most once a minute) and retried on the next iteration; an event
the coordinator refuses (``ValueError``: too large, not JSON) is logged and dropped. At
most ``max_pending`` events wait; beyond that the oldest are dropped (and counted).

Each event is published as ``kind`` = the record's ``type``, ``payload`` = the whole
record (``type``, ``time``, ``rank``, ``pid``, ``worker`` and its fields), ``source`` =
the agent's worker name. :func:`as_record` turns a coordinator event back into a record
like the ones in ``metrics_dir``, with ``seq`` added (and ``worker`` = the event's
``source`` where the payload has none: an event another program published).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from typing import Any

from elastic._ratelog import RateLimitedLog

__all__ = ["EventPublisher", "as_record", "coordinator_of"]

log = logging.getLogger("elastic.agent")



def coordinator_of(target: Any) -> Any:
    """The object with ``publish``/``events`` behind ``target`` (a Coordinator, or a Dataset
    that exposes its ``coordinator``), or None (a URL not connected yet, nothing given)."""
    if target is None or isinstance(target, str):
        return None
    if hasattr(target, "publish") and hasattr(target, "events"):
        return target
    coordinator = getattr(target, "coordinator", None)
    if hasattr(coordinator, "publish") and hasattr(coordinator, "events"):
        return coordinator
    return None


def as_record(event: dict[str, Any]) -> dict[str, Any]:
    """A coordinator event as a metrics record: its payload, plus ``type``, ``worker`` (the
    event's source), ``seq``. A payload's own ``source`` field (a hang's detector, a load's
    origin) is kept."""
    payload = event.get("payload")
    record = dict(payload) if isinstance(payload, dict) else {"payload": payload}
    record.setdefault("type", event.get("kind"))
    record.setdefault("time", event.get("time"))
    record.setdefault("worker", event.get("source"))
    record["seq"] = event.get("seq")
    return record


class EventPublisher:
    """Queue of one agent's events on their way to the coordinator's log."""

    def __init__(self, source: str, *, max_pending: int = 10_000) -> None:
        self.source = source
        self.max_pending = max_pending
        self.published = 0
        self.dropped = 0
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._queue_lock = threading.Lock()  # held for a deque operation only
        self._publish_lock = threading.Lock()  # one publisher at a time keeps the order
        self._errors = RateLimitedLog(log)

    def put(self, record: dict[str, Any]) -> None:
        """Queue ``record`` (any thread; no I/O)."""
        with self._queue_lock:
            self._queue.append(record)
            if len(self._queue) > self.max_pending:
                self._queue.popleft()
                self.dropped += 1

    def pending(self) -> list[dict[str, Any]]:
        """The queued events, oldest first."""
        with self._queue_lock:
            return list(self._queue)

    def publish(self, coordinator: Any, *, budget_seconds: float = 0.5) -> bool:
        """Publish queued events, oldest first, for about ``budget_seconds`` (the agent
        thread; the calls block on the coordinator). True if the queue is empty after."""
        target = coordinator_of(coordinator)
        if target is None:
            return not self._queue
        if not self._publish_lock.acquire(timeout=budget_seconds):
            return False
        try:
            deadline = time.monotonic() + budget_seconds
            while time.monotonic() < deadline:
                with self._queue_lock:
                    record = self._queue[0] if self._queue else None
                if record is None:
                    return True
                try:
                    # strict JSON, as the coordinator wants it (the metrics file uses default=str)
                    payload = json.loads(json.dumps(record, default=str))
                    target.publish(str(record.get("type") or "event"), payload, source=self.source)
                except ValueError as err:  # refused (too large, not JSON): it never will be
                    log.warning("elastic agent: dropping event %r the coordinator refused: %s",
                                record.get("type"), err)
                    self.dropped += 1
                except Exception as err:  # unreachable, locked: keep it, try again later
                    self._errors.warning("cannot publish events to the coordinator (%d waiting): %s",
                                    len(self._queue), err)
                    return False
                else:
                    self.published += 1
                with self._queue_lock:
                    if self._queue and self._queue[0] is record:
                        self._queue.popleft()
            return not self._queue
        finally:
            self._publish_lock.release()

    def flush(self, coordinator: Any, *, timeout: float) -> bool:
        """A last try before the process exits: publish what is queued, on a short-lived
        thread, waiting at most ``timeout`` seconds (a call stuck on an unreachable
        coordinator must not hold the exit). A URL not connected yet is connected there.
        True if everything was published."""
        if not self._queue or coordinator is None:
            return not self._queue
        done = threading.Event()

        def last_try() -> None:
            target = coordinator
            if isinstance(target, str):
                try:
                    import sharding

                    target = sharding.connect(target)
                except Exception as err:
                    self._errors.warning("cannot connect to the coordinator to publish events: %s", err)
                    return
            if self.publish(target, budget_seconds=timeout):
                done.set()

        thread = threading.Thread(target=last_try, name="elastic-agent-events", daemon=True)
        thread.start()
        thread.join(timeout)
        if not done.is_set():
            log.warning("elastic agent: %d events not published to the coordinator before exit",
                        len(self._queue))
        return done.is_set()

