"""``sqlite:///abs/path``: lease state in one SQLite file, for processes on one machine.

Each operation is one ``BEGIN IMMEDIATE`` transaction that reads the data set's lease
table (a small JSON document: epoch, cursor, queue, leases), applies the same
transition as the memory store, and writes it back. WAL mode with
``synchronous=NORMAL``: a committed transaction survives any process crash (only a
power loss may drop the last few); a killed worker can never leave a half-written state.

Trade-off: the whole table is rewritten per operation, so cost grows with the number of
outstanding leases; fine for the tens of workers of one machine, use Redis beyond.
Writers are serialised by an advisory ``flock`` on ``PATH.lock`` before SQLite's own
lock, so waiters wake as soon as the lock is free instead of sleeping in SQLite's busy
handler; SQLite's busy timeout still guards against writers that do not take the flock.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from ._errors import CoordinatorError, CoordinatorUnavailable
from ._store import Ask, Event, Grant, Lease, Status, Wait
from ._table import LeaseTable

__all__ = ["SQLiteStore"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS datasets (name TEXT PRIMARY KEY, definition TEXT NOT NULL, state TEXT NOT NULL)",
    # AUTOINCREMENT: a sequence number is never reused, even after old events are dropped
    "CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL,"
    " source TEXT NOT NULL, kind TEXT NOT NULL, payload TEXT NOT NULL)",
)


class SQLiteStore:
    """Store over one SQLite file; safe for many processes and threads."""

    def __init__(self, path: str, *, url: str, busy_timeout: float) -> None:
        self._path, self._url, self._busy_timeout = path, url, busy_timeout
        self._lock = threading.Lock()
        self._pid = -1
        self._db: sqlite3.Connection | None = None
        self._flock_fd = -1
        self._connection()

    # -- connection ------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is not None and self._pid == os.getpid():
            return self._db
        flock_fd = -1
        try:
            flock_fd = os.open(self._path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            # one process at a time switches to WAL and creates the schema: SQLite answers a
            # journal-mode change that meets another "database is locked" at once, with no wait
            fcntl.flock(flock_fd, fcntl.LOCK_EX)
            try:
                db = sqlite3.connect(self._path, timeout=self._busy_timeout, isolation_level=None,
                                     check_same_thread=False)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                for statement in _SCHEMA:
                    db.execute(statement)
            finally:
                fcntl.flock(flock_fd, fcntl.LOCK_UN)
        except (sqlite3.Error, OSError) as exc:
            if flock_fd >= 0:
                os.close(flock_fd)
            raise CoordinatorError(f"cannot open {self._url}: {exc}") from exc
        self._db, self._pid, self._flock_fd = db, os.getpid(), flock_fd
        return db

    def _transact(self, name: str, change: Callable[[LeaseTable, float], T], *, write: bool = True) -> T:
        """Apply ``change`` to data set ``name``'s lease table in one write transaction."""

        def run(db: sqlite3.Connection) -> T:
            row = db.execute("SELECT state FROM datasets WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise CoordinatorError(f"{self._url}: data set {name!r} has no state")
            table = LeaseTable.from_json(json.loads(row[0]), 0.0)
            result = change(table, time.time())
            if write:
                state = json.dumps(table.to_json(0.0), separators=(",", ":"))
                db.execute("UPDATE datasets SET state = ? WHERE name = ?", (state, name))
            return result

        return self._write(run, what=f"state of {name!r}")

    def _write(self, run: Callable[[sqlite3.Connection], T], *, what: str) -> T:
        """``run(db)`` inside ``BEGIN IMMEDIATE`` ... ``COMMIT`` under the writers' flock."""
        with self._lock:
            db = self._connection()
            fcntl.flock(self._flock_fd, fcntl.LOCK_EX)
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    result = run(db)
                    db.execute("COMMIT")
                    return result
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    raise CoordinatorUnavailable(f"{self._url}: database stayed locked for {self._busy_timeout}s") from exc
                raise CoordinatorError(f"{self._url}: {exc}") from exc
            except (sqlite3.DatabaseError, ValueError, KeyError, TypeError) as exc:
                raise CoordinatorError(f"{self._url}: corrupt or unreadable {what}: {exc!r}") from exc
            finally:
                fcntl.flock(self._flock_fd, fcntl.LOCK_UN)

    # -- Store -----------------------------------------------------------------------

    def define(self, name: str, definition: str | None) -> str | None:
        with self._lock:
            db = self._connection()
            try:
                if definition is not None:
                    empty = json.dumps(LeaseTable().to_json(0.0))
                    db.execute(
                        "INSERT OR IGNORE INTO datasets (name, definition, state) VALUES (?, ?, ?)",
                        (name, definition, empty),
                    )
                row = db.execute("SELECT definition FROM datasets WHERE name = ?", (name,)).fetchone()
            except sqlite3.Error as exc:
                raise CoordinatorError(f"{self._url}: {exc}") from exc
            return None if row is None else str(row[0])

    def report(
        self, name: str, *, epoch: int, slot: int, token: int, consumed: int, lease_timeout: float,
        step: int | None = None,
    ) -> tuple[Status, str | None]:
        return self._transact(
            name, lambda t, now: t.report(epoch, slot, token, consumed, now, lease_timeout=lease_timeout, step=step)
        )

    def complete(
        self, name: str, *, epoch: int, slot: int, token: int, step: int | None = None
    ) -> tuple[Status, str | None]:
        return self._transact(name, lambda t, now: t.complete(epoch, slot, token, step))

    def complete_and_acquire(
        self, name: str, *, done: Sequence[Lease], ask: Ask
    ) -> tuple[list[tuple[Status, str | None]], list[Grant | Wait | None]]:
        return self._transact(name, lambda t, now: t.complete_and_acquire(done, now, ask))

    def heartbeat(self, name: str, worker: str, *, lease_timeout: float) -> int:
        return self._transact(name, lambda t, now: t.heartbeat(worker, now, lease_timeout=lease_timeout))

    def release(self, name: str, worker: str) -> int | None:
        return self._transact(name, lambda t, now: t.release(worker))

    def snapshot(self, name: str) -> dict[str, Any]:
        return self._transact(name, lambda t, now: t.to_json(now), write=False)

    def restore(self, name: str, state: dict[str, Any]) -> None:
        self._transact(name, lambda t, now: t.restore(state))

    def publish(self, kind: str, source: str, payload: str, *, keep: int) -> int:
        def run(db: sqlite3.Connection) -> int:
            seq = db.execute(
                "INSERT INTO events (time, source, kind, payload) VALUES (?, ?, ?, ?)",
                (time.time(), source, kind, payload),
            ).lastrowid
            assert seq is not None
            db.execute("DELETE FROM events WHERE seq <= ?", (seq - keep,))
            return int(seq)

        return self._write(run, what="event log")

    def events(self, since: int, limit: int | None) -> list[Event]:
        with self._lock:
            try:
                rows = self._connection().execute(
                    "SELECT seq, time, source, kind, payload FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                    (since, -1 if limit is None else limit),
                ).fetchall()
            except sqlite3.Error as exc:
                raise CoordinatorError(f"{self._url}: cannot read the event log: {exc}") from exc
        return [(int(seq), float(at), str(source), str(kind), str(payload)) for seq, at, source, kind, payload in rows]

    def close(self) -> None:
        with self._lock:
            if self._db is not None and self._pid == os.getpid():
                self._db.close()
                os.close(self._flock_fd)
            self._db = None
