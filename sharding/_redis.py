"""``redis://[:password@]host:port/db``: lease state in Redis, for workers on many machines.

Every operation is one Lua script (``_redis_scripts``), so it is atomic on the server.

Client side, each process keeps one connection (``_resp.Connection``, shared by its
threads under a lock; a forked child opens its own) and sends ``EVALSHA`` commands it
packs itself from cached byte prefixes, then reads the reply: no connection pool, no
per-call script lookup, one ``send`` and one ``recv`` system call per operation. A
``NOSCRIPT`` reply (a restarted or flushed server) loads the script and resends.

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
import importlib.util
import itertools
import json
import logging
import os
import random
import threading
import time
import weakref
from typing import Any, Sequence

from ._errors import CoordinatorError, CoordinatorUnavailable
from ._redis_scripts import SCRIPTS
from ._resp import Connection, ReplyError, bulk as _bulk, command
from ._store import Ask, Event, Grant, Lease, Status, Wait

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)

_STATUS = {status.value.encode(): status for status in Status}
_RETRY = (b"$1\r\n0\r\n", b"$1\r\n1\r\n")  # complete_acquire's retry argument: is this a retry
_PING = command(b"PING")
#: error replies that mean the password is wrong or missing
_AUTH_ERRORS = ("NOAUTH", "WRONGPASS", "ERR invalid password", "ERR AUTH", "ERR Client sent AUTH")


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
        if importlib.util.find_spec("hiredis") is None:  # the parser of _resp.Connection
            raise CoordinatorError(f"{url} needs the hiredis package: pip install 'flashckpt[redis]'")
        self._url, self._prefix, self._retry_seconds = url, key_prefix, retry_seconds
        self._address: dict[str, Any] = dict(host=host, port=port, password=password, db=db, timeout=socket_timeout)
        self._lock = threading.Lock()
        self._connection: Connection | None = None
        self._sha = {op: hashlib.sha1(source.encode()).hexdigest().encode() for op, source in SCRIPTS.items()}
        self._heads: dict[tuple[str, str, int], bytes] = {}
        self._acquire_heads: dict[tuple[str, Ask, int], bytes] = {}
        self._requests = itertools.count()
        self._instance = os.urandom(6).hex()
        self._request_prefix = self._new_request_prefix()
        _STORES.add(self)
        try:
            self._roundtrip(_PING, None)
        except (ReplyError, OSError) as exc:
            if _retryable(exc):
                raise CoordinatorUnavailable(f"cannot reach {url}: {exc}") from exc
            raise _refused(f"cannot use {url}", exc) from exc

    # -- transport -----------------------------------------------------------------------

    def _roundtrip(self, packed: bytes, op: str | None) -> Any:
        """Send one packed command and read its reply; load script ``op`` on NOSCRIPT."""
        with self._lock:
            connection = self._connection
            if connection is None:  # first use, after a broken one, or in a forked child
                connection = self._connection = Connection(**self._address)
            try:
                try:
                    return connection.roundtrip(packed)
                except ReplyError as exc:
                    if op is None or not str(exc).startswith("NOSCRIPT"):
                        raise
                log.info("%s: loading script %s", self._url, op)
                connection.roundtrip(command(b"SCRIPT", b"LOAD", SCRIPTS[op]))
                return connection.roundtrip(packed)
            except ReplyError:
                raise  # the connection is in step: the reply was read whole
            except BaseException:
                connection.close()  # the next attempt connects afresh
                self._connection = None
                raise

    def _call(
        self, packed: bytes, op: str | None, *, retry: bytes | None = None, retried: list[bool] | None = None
    ) -> Any:
        """Round trip ``packed`` (``retry``, if given, on later attempts), retrying
        connection errors (and a server still loading its data) with backoff for
        ``retry_seconds``."""
        began, delay, attempts = time.monotonic(), 0.05, 0
        while True:
            attempts += 1
            try:
                return self._roundtrip(packed, op)
            except (ReplyError, OSError) as exc:
                if not _retryable(exc):
                    raise _refused(self._url, exc) from exc
                error = exc
            if retried is not None:
                retried.append(True)
            waited = time.monotonic() - began
            if waited + delay > self._retry_seconds:
                raise CoordinatorUnavailable(
                    f"{self._url}: unreachable after {attempts} attempts over {waited:.1f}s: {error}"
                ) from error
            log.warning("%s: %s; retrying in %.2fs", self._url, error, delay)
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 2.0)
            packed = packed if retry is None else retry

    def _pack_head(self, op: str, key: str, count: int, *fixed: Any) -> bytes:
        """The packed start of ``EVALSHA sha 1 key *fixed`` for a command of ``count``
        script arguments in all."""
        head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n" % (4 + count, self._sha[op])
        return head + _bulk(key) + b"".join(_bulk(a) for a in fixed)

    def _head(self, op: str, key: str, count: int) -> bytes:
        """``_pack_head`` with no fixed arguments, cached: the same data sets repeat."""
        cache_key = (op, key, count)
        head = self._heads.get(cache_key)
        if head is None:
            if len(self._heads) > 4096:
                self._heads.clear()
            head = self._heads[cache_key] = self._pack_head(op, key, count)
        return head

    def _acquire_head(self, name: str, ask: Ask, completions: int) -> bytes:
        """``_pack_head`` of complete_acquire for ``ask`` and ``completions`` leases, cached
        under ``(name, ask, completions)``: the hot path's one dict lookup."""
        worker, lease_timeout, num_shards, num_epochs, count = ask
        head = self._pack_head(
            "complete_acquire", self._base(name), 7 + 3 * completions,
            worker, repr(lease_timeout), num_shards, -1 if num_epochs is None else num_epochs, count,
        )
        if len(self._acquire_heads) > 4096:
            self._acquire_heads.clear()
        self._acquire_heads[(name, ask, completions)] = head
        return head

    def _run(self, op: str, key: str, *args: Any, retried: list[bool] | None = None) -> Any:
        packed = self._head(op, key, len(args)) + b"".join(_bulk(a) for a in args)
        return self._call(packed, op, retried=retried)

    def _new_request_prefix(self) -> bytes:
        return b"%s-%d-" % (self._instance.encode(), os.getpid())

    def _request_id(self) -> bytes:
        """Unique per call (the same across its retries), to recognise a retried call that landed."""
        return self._request_prefix + b"%d" % next(self._requests)

    def _forked(self) -> None:
        """In a forked child: the parent's connection and lock are not ours to use."""
        self._lock = threading.Lock()
        self._connection = None
        self._request_prefix = self._new_request_prefix()

    def _base(self, name: str) -> str:
        return f"{self._prefix}{{{name}}}:"

    # -- Store ---------------------------------------------------------------------------

    def define(self, name: str, definition: str | None) -> str | None:
        stored = self._run("define", self._base(name), definition or "")
        return None if stored is None else stored.decode()

    def complete_and_acquire(
        self, name: str, *, done: Sequence[Lease], ask: Ask
    ) -> tuple[list[tuple[Status, str | None]], list[Grant | Wait | None]]:
        head = self._acquire_heads.get((name, ask, len(done)))
        if head is None:
            head = self._acquire_head(name, ask, len(done))
        request = _bulk(self._request_id())
        leases = _lease_args(done)
        retried: list[bool] = []
        reply = self._call(
            head + request + _RETRY[0] + leases, "complete_acquire", retry=head + request + _RETRY[1] + leases, retried=retried
        )
        statuses, answers = _parse_complete_acquire(reply)
        if retried and any(s is Status.DONE for s, _ in statuses):
            # the first attempt completed them; what it acquired, it did not hold on to
            log.info("%s: completions landed before the connection broke", self._url)
            statuses = [(Status.OK, h) if s is Status.DONE else (s, h) for s, h in statuses]
            if all(s is Status.OK for s, _ in statuses):
                answers = self.complete_and_acquire(name, done=(), ask=ask)[1]
        return statuses, answers

    def report(
        self, name: str, *, epoch: int, slot: int, token: int, consumed: int, lease_timeout: float,
        step: int | None = None,
    ) -> tuple[Status, str | None]:
        status, worker = self._run("report", self._base(name), epoch, slot, token, consumed, repr(lease_timeout),
                                   "" if step is None else step)
        return _STATUS[status], worker.decode() or None

    def complete(
        self, name: str, *, epoch: int, slot: int, token: int, step: int | None = None
    ) -> tuple[Status, str | None]:
        retried: list[bool] = []
        status, worker = self._run("complete", self._base(name), epoch, slot, token, "" if step is None else step,
                                   retried=retried)
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
        reply = self._run("snapshot", self._base(name))
        (epoch, cursor, token), queued, positions, leases, deadlines, stats, hist, completed = reply
        steps = {hist[i].decode(): hist[i + 1].decode().split("|") for i in range(0, len(hist), 2)}  # held leases
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
            slot = leases[i].decode()
            at, before = steps.get(slot, ("-1", ""))
            table[slot] = {
                "worker": worker,
                "token": int(held),
                "consumed": int(consumed),
                "expires_in": float(deadlines[i // 2]),
                "step": int(at),
                "before": [int(x) for x in before.split(":")] if before else None,
            }
        return {
            "epoch": int(epoch or 0),
            "cursor": int(cursor or 0),
            "next_token": int(token or 0),
            "queue": [[int(s), int(c)] for s, c in zip(queued, positions)],
            "leases": dict(sorted(table.items(), key=lambda kv: int(kv[0]))),
            "workers": workers,
            "completed_at": {completed[i].decode(): _completion(completed[i + 1].decode())
                             for i in range(0, len(completed), 2)},
        }

    def restore(self, name: str, state: dict[str, Any]) -> None:
        self._run("restore", self._base(name), json.dumps(state))

    def publish(self, kind: str, source: str, payload: str, *, keep: int) -> int:
        return int(self._run("publish", self._prefix + "{events}:", source, kind, payload, keep, self._request_id()))

    def events(self, since: int, limit: int | None) -> list[Event]:
        page = () if limit is None else (b"LIMIT", 0, limit)
        packed = command(b"ZRANGEBYSCORE", self._prefix + "{events}:elog", f"({since}", b"+inf", *page)
        events: list[Event] = []
        for row in self._call(packed, None):
            seq, at, source, kind, payload = json.loads(row)
            events.append((int(seq), float(at), source, kind, payload))
        return events

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
            self._connection = None


def _completion(entry: str) -> list[Any]:
    """``epoch|step|consumed|at|before`` as ``LeaseTable.completed_at`` holds it."""
    epoch, step, consumed, at, before = entry.split("|")
    return [int(epoch), int(step), int(at), int(consumed), [int(x) for x in before.split(":")] if before else None]


def _retryable(error: ReplyError | OSError) -> bool:
    """A connection error, or a server still loading its data: worth another attempt."""
    return isinstance(error, OSError) or str(error).startswith("LOADING")


def _refused(where: str, error: ReplyError) -> CoordinatorError:
    """An error reply that retrying will not change, as the coordinator's error."""
    message = str(error)
    if message.startswith(_AUTH_ERRORS):
        return CoordinatorError(f"{where}: authentication failed: {message}")
    if message.startswith("NODATASET"):  # the scripts' own error: the data set's keys are gone
        name = message.partition("{")[2].rpartition("}")[0]
        return CoordinatorError(
            f"{where}: the state of data set {name!r} is gone from the server (restarted without persistence, "
            "or its keys deleted): load_state_dict of a checkpoint's state, or of initial_state() to start over")
    return CoordinatorError(f"{where}: {message}")


def _lease_args(done: Sequence[Lease]) -> bytes:
    """Epoch, slot and token of each lease as three packed script arguments."""
    packed = []
    for epoch, slot, token in done:
        e, s, t = b"%d" % epoch, b"%d" % slot, b"%d" % token
        packed.append(b"$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(e), e, len(s), s, len(t), t))
    return b"".join(packed)


#: every store of this process, so that a forked child drops their connections
_STORES: "weakref.WeakSet[RedisStore]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _parse_complete_acquire(reply: list[Any]) -> tuple[list[tuple[Status, str | None]], list[Grant | Wait | None]]:
    """complete_acquire's reply: the count n of completions, n (status, holder) pairs, then
    the acquires' replies (5 items a grant, 2 a wait, 1 none)."""
    end = 1 + 2 * reply[0]
    statuses = [(_STATUS[reply[i]], reply[i + 1].decode() or None) for i in range(1, end, 2)]
    answers: list[Grant | Wait | None] = []
    i, end = end, len(reply)
    while i < end:
        kind = reply[i]
        if kind == b"grant":
            answers.append(Grant(reply[i + 1], reply[i + 2], reply[i + 3], reply[i + 4]))
            i += 5
        elif kind == b"wait":
            answers.append(Wait(float(reply[i + 1])))
            i += 2
        else:
            answers.append(None)
            i += 1
    return statuses, answers
