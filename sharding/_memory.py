"""``memory://NAME``: lease state in this process, guarded by a lock.

For tests and notebooks. Every ``connect`` with the same URL in one process shares one
store; nothing is shared between processes and nothing survives the process.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import Any, Sequence

from ._store import Ask, Event, Grant, Lease, Status, Wait
from ._table import LeaseTable

__all__ = ["MemoryStore", "memory_store"]

_registry: dict[str, "MemoryStore"] = {}
_registry_lock = threading.Lock()


def memory_store(name: str) -> "MemoryStore":
    """The process-wide store called ``name``."""
    with _registry_lock:
        return _registry.setdefault(name, MemoryStore())


class MemoryStore:
    """In-process store: a dict of definitions and lease tables under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._definitions: dict[str, str] = {}
        self._tables: dict[str, LeaseTable] = {}
        self._events: deque[Event] = deque()
        self._seq = 0

    def define(self, name: str, definition: str | None) -> str | None:
        with self._lock:
            if definition is not None and name not in self._definitions:
                self._definitions[name] = definition
                self._tables[name] = LeaseTable()
            return self._definitions.get(name)

    def report(
        self, name: str, *, epoch: int, slot: int, token: int, consumed: int, lease_timeout: float,
        step: int | None = None,
    ) -> tuple[Status, str | None]:
        with self._lock:
            return self._tables[name].report(epoch, slot, token, consumed, time.time(), lease_timeout=lease_timeout,
                                             step=step)

    def complete(
        self, name: str, *, epoch: int, slot: int, token: int, step: int | None = None
    ) -> tuple[Status, str | None]:
        with self._lock:
            return self._tables[name].complete(epoch, slot, token, step)

    def complete_and_acquire(
        self, name: str, *, done: Sequence[Lease], ask: Ask
    ) -> tuple[list[tuple[Status, str | None]], list[Grant | Wait | None]]:
        with self._lock:
            return self._tables[name].complete_and_acquire(done, time.time(), ask)

    def heartbeat(self, name: str, worker: str, *, lease_timeout: float) -> int:
        with self._lock:
            return self._tables[name].heartbeat(worker, time.time(), lease_timeout=lease_timeout)

    def release(self, name: str, worker: str) -> int | None:
        with self._lock:
            return self._tables[name].release(worker)

    def snapshot(self, name: str) -> dict[str, Any]:
        with self._lock:
            return self._tables[name].to_json(time.time())

    def restore(self, name: str, state: dict[str, Any]) -> None:
        with self._lock:
            self._tables[name].restore(state)

    def publish(self, kind: str, source: str, payload: str, *, keep: int) -> int:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, time.time(), source, kind, payload))
            while len(self._events) > keep:
                self._events.popleft()
            return self._seq

    def events(self, since: int, limit: int | None) -> list[Event]:
        with self._lock:
            first = bisect.bisect_right(self._events, since, key=lambda event: event[0])
            stop = len(self._events) if limit is None else min(len(self._events), first + limit)
            return [self._events[i] for i in range(first, stop)]

    def close(self) -> None:
        """Nothing to release: the state lives as long as the process."""
