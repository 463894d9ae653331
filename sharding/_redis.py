"""``redis://[:password@]host:port/db``: lease state in Redis, for workers on many machines.

Every operation is one Lua script (``_redis_scripts``), so it is atomic on the server.

Client side, each process keeps one connection (shared by its threads under a lock) and
sends ``EVALSHA`` commands it packs itself from cached byte prefixes, then reads the reply:
no connection pool, no per-call script lookup, one ``sendall`` and one reply per
operation. A ``NOSCRIPT`` reply (a restarted or flushed server) loads the script and
resends.

Durability is Redis's: with AOF and ``appendfsync always`` an acknowledged operation
survives a server restart. Calls that fail on connection errors are retried with
exponential backoff for ``retry_seconds``, on a fresh connection each time. Every call
carries a request id: a retried ``acquire`` (or ``complete_and_acquire``) whose first
attempt landed gets back the lease that attempt took, instead of leaving an orphan lease
that the worker's heartbeats would keep alive for ever; a retried ``complete`` that finds
its shard done counts as success (the first attempt landed, the reply was lost); a
retried ``publish`` is not appended twice.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
import threading
import time
from typing import Any, Callable, Sequence

from ._errors import CoordinatorError, CoordinatorUnavailable
from ._redis_scripts import SCRIPTS
from ._store import Ask, Event, Grant, Lease, Status, Wait

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)

_STATUS = {status.value.encode(): status for status in Status}
_RETRY = (b"$1\r\n0\r\n", b"$1\r\n1\r\n")  # complete_acquire's retry argument: is this a retry
_PING = b"*1\r\n$4\r\nPING\r\n"


def _bulk(value: Any) -> bytes:
    """One RESP bulk string."""
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def _command(*args: Any) -> bytes:
    """A whole RESP command."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


class RedisStore:
    """Store in a Redis server; every operation is one Lua script."""

    def __init__(
        self,
        *,
        url: str,
        host: str,
        port: int,
        db: int,
        password: str | None,
        key_prefix: str,
        retry_seconds: float,
        socket_timeout: float,
    ) -> None:
        # imported here: `import sharding` must not need redis
        from redis import exceptions as errors
        from redis.backoff import NoBackoff
        from redis.connection import Connection
        from redis.retry import Retry

        self._errors = errors
        self._retryable = (errors.ConnectionError, errors.TimeoutError)  # BusyLoadingError is one
        self._url, self._prefix, self._retry_seconds = url, key_prefix, retry_seconds
        self._connection_args: dict[str, Any] = dict(
            host=host,
            port=port,
            db=db,
            password=password,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),  # retries are ours, with backoff and a budget
        )
        self._new_connection = Connection
        self._lock = threading.Lock()
        self._connection: Any = None
        self._pid = -1
        self._sha = {op: hashlib.sha1(source.encode()).hexdigest().encode() for op, source in SCRIPTS.items()}
        self._heads: dict[tuple[Any, ...], bytes] = {}
        self._requests = itertools.count()
        self._instance = os.urandom(6).hex()
        try:
            self._roundtrip(_PING, None)
        except errors.AuthenticationError as exc:
            raise CoordinatorError(f"cannot use {url}: authentication failed: {exc}") from exc
        except errors.RedisError as exc:
            raise CoordinatorUnavailable(f"cannot reach {url}: {exc}") from exc

    # -- transport -----------------------------------------------------------------------

    def _roundtrip(self, packed: bytes, op: str | None) -> Any:
        """Send one packed command and read its reply; load script ``op`` on NOSCRIPT."""
        errors = self._errors
        with self._lock:
            if self._connection is None or self._pid != os.getpid():  # first use, or forked
                self._connection, self._pid = self._new_connection(**self._connection_args), os.getpid()
            connection = self._connection
            try:
                connection.send_packed_command([packed], check_health=False)
                try:
                    return connection.read_response()
                except errors.NoScriptError:
                    if op is None:
                        raise
                log.info("%s: loading script %s", self._url, op)
                connection.send_packed_command([_command(b"SCRIPT", b"LOAD", SCRIPTS[op])], check_health=False)
                connection.read_response()
                connection.send_packed_command([packed], check_health=False)
                return connection.read_response()
            except errors.ResponseError:
                raise  # the connection is in step: the reply was read whole
            except BaseException:
                connection.disconnect()  # the next attempt connects afresh
                raise

    def _call(self, pack: Callable[[bool], bytes], op: str | None, *, retried: list[bool] | None = None) -> Any:
        """Round trip ``pack(retry)``, retrying connection errors with backoff for ``retry_seconds``."""
        errors = self._errors
        began, delay, attempts = time.monotonic(), 0.05, 0
        while True:
            attempts += 1
            try:
                return self._roundtrip(pack(attempts > 1), op)
            except errors.AuthenticationError as exc:
                raise CoordinatorError(f"{self._url}: authentication failed: {exc}") from exc
            except self._retryable as exc:
                if retried is not None:
                    retried.append(True)
                waited = time.monotonic() - began
                if waited + delay > self._retry_seconds:
                    raise CoordinatorUnavailable(
                        f"{self._url}: unreachable after {attempts} attempts over {waited:.1f}s: {exc}"
                    ) from exc
                log.warning("%s: %s; retrying in %.2fs", self._url, exc, delay)
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 2.0)
            except errors.RedisError as exc:
                raise CoordinatorError(f"{self._url}: {exc}") from exc

    def _head(self, op: str, key: str, count: int, *fixed: Any) -> bytes:
        """The packed start of ``EVALSHA sha 1 key *fixed`` for a command of ``count``
        script arguments in all (cached: the same data set and worker repeat)."""
        cache_key = (op, key, count, *fixed)
        head = self._heads.get(cache_key)
        if head is None:
            if len(self._heads) > 4096:
                self._heads.clear()
            head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n" % (4 + count, self._sha[op])
            head += _bulk(key) + b"".join(_bulk(a) for a in fixed)
            self._heads[cache_key] = head
        return head

    def _run(self, op: str, key: str, *args: Any, retried: list[bool] | None = None) -> Any:
        packed = self._head(op, key, len(args)) + b"".join(_bulk(a) for a in args)
        return self._call(lambda retry: packed, op, retried=retried)

    def _request_id(self) -> bytes:
        """Unique per call (the same across its retries), to recognise a retried call that landed."""
        return b"%s-%d-%d" % (self._instance.encode(), os.getpid(), next(self._requests))

    def _base(self, name: str) -> str:
        return f"{self._prefix}{{{name}}}:"

    # -- Store ---------------------------------------------------------------------------

    def define(self, name: str, definition: str | None) -> str | None:
        stored = self._run("define", self._base(name), definition or "")
        return None if stored is None else stored.decode()

    def complete_and_acquire(
        self, name: str, *, done: Sequence[Lease], ask: Ask
    ) -> tuple[list[tuple[Status, str | None]], list[Grant | Wait | None]]:
        worker, lease_timeout, num_shards, num_epochs, count = ask
        head = self._head(
            "complete_acquire", self._base(name), 7 + 3 * len(done),
            worker, repr(lease_timeout), num_shards, -1 if num_epochs is None else num_epochs, count,
        )
        request = _bulk(self._request_id())
        leases = b"".join(_bulk(value) for lease in done for value in lease)
        retried: list[bool] = []
        reply = self._call(lambda retry: head + request + _RETRY[retry] + leases, "complete_acquire", retried=retried)
        n = int(reply[0])
        statuses = [(_STATUS[reply[i]], reply[i + 1].decode() or None) for i in range(1, 1 + 2 * n, 2)]
        answers = _answers(reply[1 + 2 * n:])
        if retried and any(s is Status.DONE for s, _ in statuses):
            # the first attempt completed them; what it acquired, it did not hold on to
            log.info("%s: completions landed before the connection broke", self._url)
            statuses = [(Status.OK, h) if s is Status.DONE else (s, h) for s, h in statuses]
            if all(s is Status.OK for s, _ in statuses):
                answers = self.complete_and_acquire(name, done=(), ask=ask)[1]
        return statuses, answers

    def report(
        self, name: str, *, epoch: int, slot: int, token: int, consumed: int, lease_timeout: float
    ) -> tuple[Status, str | None]:
        status, worker = self._run("report", self._base(name), epoch, slot, token, consumed, repr(lease_timeout))
        return _STATUS[status], worker.decode() or None

    def complete(self, name: str, *, epoch: int, slot: int, token: int) -> tuple[Status, str | None]:
        retried: list[bool] = []
        status, worker = self._run("complete", self._base(name), epoch, slot, token, retried=retried)
        if retried and status == b"done":
            log.info("%s: complete of slot %d landed before the connection broke", self._url, slot)
            return Status.OK, None
        return _STATUS[status], worker.decode() or None

    def heartbeat(self, name: str, worker: str, *, lease_timeout: float) -> int:
        return int(self._run("heartbeat", self._base(name), worker, repr(lease_timeout)))

    def release(self, name: str, worker: str) -> int | None:
        count = int(self._run("release", self._base(name), worker))
        return None if count < 0 else count

    def snapshot(self, name: str) -> dict[str, Any]:
        (epoch, cursor, token), queued, positions, leases, deadlines, stats = self._run("snapshot", self._base(name))
        workers: dict[str, list[int]] = {}  # acquired = completed + lost + held
        for i in range(0, len(stats), 2):
            kind, worker = stats[i].decode().split(":", 1)
            counts = workers.setdefault(worker, [0, 0])
            counts[0] += int(stats[i + 1])
            if kind == "c":
                counts[1] = int(stats[i + 1])
        table: dict[str, Any] = {}
        for i in range(0, len(leases), 2):
            held, consumed, worker = leases[i + 1].decode().rsplit("|", 1)[0].split("|", 2)
            workers.setdefault(worker, [0, 0])[0] += 1
            table[leases[i].decode()] = {
                "worker": worker,
                "token": int(held),
                "consumed": int(consumed),
                "expires_in": float(deadlines[i // 2]),
            }
        return {
            "epoch": int(epoch or 0),
            "cursor": int(cursor or 0),
            "next_token": int(token or 0),
            "queue": [[int(s), int(c)] for s, c in zip(queued, positions)],
            "leases": dict(sorted(table.items(), key=lambda kv: int(kv[0]))),
            "workers": workers,
        }

    def restore(self, name: str, state: dict[str, Any]) -> None:
        self._run("restore", self._base(name), json.dumps(state))

    def publish(self, kind: str, source: str, payload: str, *, keep: int) -> int:
        return int(self._run("publish", self._prefix + "{events}:", source, kind, payload, keep, self._request_id()))

    def events(self, since: int, limit: int | None) -> list[Event]:
        page = () if limit is None else (b"LIMIT", 0, limit)
        packed = _command(b"ZRANGEBYSCORE", self._prefix + "{events}:elog", f"({since}", b"+inf", *page)
        events: list[Event] = []
        for row in self._call(lambda retry: packed, None):
            seq, at, source, kind, payload = json.loads(row)
            events.append((int(seq), float(at), source, kind, payload))
        return events

    def close(self) -> None:
        with self._lock:
            if self._connection is not None and self._pid == os.getpid():
                self._connection.disconnect()
            self._connection = None


def _answers(flat: list[Any]) -> list[Grant | Wait | None]:
    """Acquire replies one after another (5 items a grant, 2 a wait, 1 none) as answers."""
    answers: list[Grant | Wait | None] = []
    i = 0
    while i < len(flat):
        answers.append(_granted(flat[i:i + 5]))
        i += {b"grant": 5, b"wait": 2}.get(flat[i], 1)
    return answers


def _granted(reply: list[Any]) -> Grant | Wait | None:
    """An acquire script's reply as the store protocol's answer."""
    kind = reply[0]
    if kind == b"grant":
        return Grant(int(reply[1]), int(reply[2]), int(reply[3]), int(reply[4]))
    if kind == b"wait":
        return Wait(float(reply[1]))
    return None
