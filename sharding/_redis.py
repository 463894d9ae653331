"""``redis://[:password@]host:port/db``: lease state in Redis, for workers on many machines.

Every operation is one Lua script, so it is atomic on the server. Per data set (keys share
the hash tag ``{name}`` under the key prefix): ``meta`` (epoch, cursor, token counter),
``queue`` (returned slots, front first) with ``qpos`` (their positions), ``lease``
(slot -> ``token|consumed|worker``), ``dl`` (a sorted set of leased slots by deadline, so
reclaiming expired leases is a range query), ``w:WORKER`` (a worker's slots, for heartbeat
and release) and ``stats`` (per-worker counters). Deadlines use the server clock
(``TIME``), so worker clocks need not agree.

Durability is Redis's: with AOF and ``appendfsync always`` an acknowledged operation
survives a server restart. Calls that fail on connection errors are retried with
exponential backoff for ``retry_seconds``; a retried ``complete`` that finds its shard
done counts as success (the first attempt landed, the reply was lost). A retried
``acquire`` whose first attempt landed leaves an orphan lease that expires back into the
queue: delayed, never lost.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import time
from typing import Any

from ._errors import CoordinatorError, CoordinatorUnavailable
from ._store import Event, Grant, Status, Wait

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)

_PRELUDE = """
local base = KEYS[1]
local meta, queue, qpos, lease, dl, stats =
  base..'meta', base..'queue', base..'qpos', base..'lease', base..'dl', base..'stats'
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function parse(info)
  local token, consumed, worker = string.match(info, '^(%d+)|(%d+)|(.*)$')
  return tonumber(token), tonumber(consumed), worker
end
local function drop(slot)
  local _, consumed, worker = parse(redis.call('HGET', lease, slot))
  redis.call('HDEL', lease, slot)
  redis.call('ZREM', dl, slot)
  redis.call('SREM', base..'w:'..worker, slot)
  return consumed, worker
end
local function push_front(slot, consumed)
  redis.call('LPUSH', queue, slot)
  redis.call('HSET', qpos, slot, consumed)
end
local function check(epoch, slot, token)
  local current = tonumber(redis.call('HGET', meta, 'epoch'))
  if epoch < current then return 'done', '' end
  if epoch > current then return 'unknown', '' end
  local info = redis.call('HGET', lease, slot)
  if info then
    local held, _, worker = parse(info)
    if held == token then return 'ok', worker end
    return 'held', worker
  end
  if redis.call('HEXISTS', qpos, slot) == 1 then return 'returned', '' end
  if slot < tonumber(redis.call('HGET', meta, 'cursor')) then return 'done', '' end
  return 'unknown', ''
end
"""

_ACQUIRE = """
local worker, timeout = ARGV[1], tonumber(ARGV[2])
local num_shards, num_epochs = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = clock()
local flat = redis.call('ZRANGEBYSCORE', dl, '-inf', now, 'WITHSCORES')
local expired = {}
for i = 1, #flat, 2 do expired[#expired + 1] = {tonumber(flat[i + 1]), tonumber(flat[i])} end
table.sort(expired, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
for i = #expired, 1, -1 do
  local slot = expired[i][2]
  push_front(slot, (drop(slot)))
end
local epoch = tonumber(redis.call('HGET', meta, 'epoch'))
local cursor = tonumber(redis.call('HGET', meta, 'cursor'))
local slot, consumed
local front = redis.call('LPOP', queue)
if front then
  slot, consumed = tonumber(front), tonumber(redis.call('HGET', qpos, front))
  redis.call('HDEL', qpos, front)
elseif cursor < num_shards then
  slot, consumed = cursor, 0
  redis.call('HSET', meta, 'cursor', cursor + 1)
elseif redis.call('HLEN', lease) > 0 then
  local first = redis.call('ZRANGE', dl, 0, 0, 'WITHSCORES')
  return {'wait', tostring(math.max(0, tonumber(first[2]) - now))}
elseif num_epochs >= 0 and epoch + 1 >= num_epochs then
  return {'none'}
else
  epoch, slot, consumed = epoch + 1, 0, 0
  redis.call('HSET', meta, 'epoch', epoch, 'cursor', 1)
end
local token = redis.call('HINCRBY', meta, 'token', 1)
redis.call('HSET', lease, slot, token..'|'..consumed..'|'..worker)
redis.call('ZADD', dl, now + timeout, slot)
redis.call('SADD', base..'w:'..worker, slot)
redis.call('HINCRBY', stats, 'a:'..worker, 1)
redis.call('HINCRBY', stats, 'c:'..worker, 0)
return {'grant', epoch, slot, consumed, token}
"""

_REPORT = """
local epoch, slot, token = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local consumed, timeout = tonumber(ARGV[4]), tonumber(ARGV[5])
local status, worker = check(epoch, slot, token)
if status == 'ok' then
  redis.call('HSET', lease, slot, token..'|'..consumed..'|'..worker)
  redis.call('ZADD', dl, clock() + timeout, slot)
end
return {status, worker}
"""

_COMPLETE = """
local epoch, slot, token = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local status, worker = check(epoch, slot, token)
if status == 'ok' then
  drop(slot)
  redis.call('HINCRBY', stats, 'c:'..worker, 1)
end
return {status, worker}
"""

_HEARTBEAT = """
local worker, timeout = ARGV[1], tonumber(ARGV[2])
redis.call('HSETNX', stats, 'a:'..worker, 0)
redis.call('HSETNX', stats, 'c:'..worker, 0)
local slots = redis.call('SMEMBERS', base..'w:'..worker)
local deadline = clock() + timeout
for _, slot in ipairs(slots) do redis.call('ZADD', dl, 'XX', deadline, slot) end
return #slots
"""

_RELEASE = """
local worker = ARGV[1]
if redis.call('HEXISTS', stats, 'a:'..worker) == 0 then return -1 end
local slots = redis.call('SMEMBERS', base..'w:'..worker)
for i, slot in ipairs(slots) do slots[i] = tonumber(slot) end
table.sort(slots)
for i = #slots, 1, -1 do push_front(slots[i], (drop(slots[i]))) end
return #slots
"""

_SNAPSHOT = """
local now = clock()
local queued = redis.call('LRANGE', queue, 0, -1)
local positions = {}
for i, slot in ipairs(queued) do positions[i] = redis.call('HGET', qpos, slot) end
local leases = redis.call('HGETALL', lease)
local deadlines = {}
for i = 1, #leases, 2 do deadlines[#deadlines + 1] = tostring(redis.call('ZSCORE', dl, leases[i]) - now) end
return {redis.call('HMGET', meta, 'epoch', 'cursor', 'token'), queued, positions, leases, deadlines,
        redis.call('HGETALL', stats)}
"""

# The job-wide event log (keys under the hash tag {events}: ``eseq`` the counter, ``elog``
# a sorted set of JSON [seq, time, source, kind, payload] by seq, ``ereq`` each source's
# last request id and seq, so a publish retried after a lost reply is not appended twice).
_PUBLISH = """
local base, source, kind, payload = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local keep, request = tonumber(ARGV[4]), ARGV[5]
local last = redis.call('HGET', base..'ereq', source)
if last then
  local id, seq = string.match(last, '^(.*)|(%d+)$')
  if id == request then return tonumber(seq) end
end
local seq = redis.call('INCR', base..'eseq')
local t = redis.call('TIME')
local at = t[1]..'.'..string.format('%06d', tonumber(t[2]))
redis.call('ZADD', base..'elog', seq, cjson.encode({seq, at, source, kind, payload}))
redis.call('ZREMRANGEBYRANK', base..'elog', 0, -keep - 1)
redis.call('HSET', base..'ereq', source, request..'|'..seq)
return seq
"""

_RESTORE = """
local state = cjson.decode(ARGV[1])
local leases = redis.call('HGETALL', lease)
for i = 2, #leases, 2 do
  local _, _, worker = parse(leases[i])
  redis.call('DEL', base..'w:'..worker)
end
redis.call('DEL', queue, qpos, lease, dl, stats)
redis.call('HSET', meta, 'epoch', state['epoch'], 'cursor', state['cursor'])
for _, entry in ipairs(state['queue']) do
  redis.call('RPUSH', queue, entry[1])
  redis.call('HSET', qpos, entry[1], entry[2])
end
for worker, counts in pairs(state['workers']) do
  redis.call('HSET', stats, 'a:'..worker, counts[1], 'c:'..worker, counts[2])
end
return 1
"""


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
        import redis  # imported here: `import sharding` must not need redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis_errors = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
        self._url, self._prefix, self._retry_seconds = url, key_prefix, retry_seconds
        self._client = redis.Redis(
            host=host,
            port=port,
            db=db,
            password=password,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),  # retries are ours, with backoff and a budget
        )
        scripts = {
            "acquire": _ACQUIRE,
            "report": _REPORT,
            "complete": _COMPLETE,
            "heartbeat": _HEARTBEAT,
            "release": _RELEASE,
            "snapshot": _SNAPSHOT,
            "restore": _RESTORE,
        }
        self._scripts = {op: self._client.register_script(_PRELUDE + body) for op, body in scripts.items()}
        self._scripts["publish"] = self._client.register_script(_PUBLISH)
        self._requests = itertools.count()
        self._instance = os.urandom(6).hex()
        try:
            self._client.ping()
        except redis.AuthenticationError as exc:
            raise CoordinatorError(f"cannot use {url}: authentication failed: {exc}") from exc
        except redis.RedisError as exc:
            raise CoordinatorUnavailable(f"cannot reach {url}: {exc}") from exc

    def _base(self, name: str) -> str:
        return f"{self._prefix}{{{name}}}:"

    def _call(self, what: Any, *, retried: list[bool] | None = None) -> Any:
        """Run ``what()``, retrying connection errors with backoff for ``retry_seconds``."""
        import redis

        began, delay, attempts = time.monotonic(), 0.05, 0
        while True:
            attempts += 1
            try:
                return what()
            except self._redis_errors as exc:
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
            except redis.RedisError as exc:
                raise CoordinatorError(f"{self._url}: {exc}") from exc

    def _run(self, op: str, name: str, *args: Any, retried: list[bool] | None = None) -> Any:
        script = self._scripts[op]
        return self._call(lambda: script(keys=[self._base(name)], args=list(args)), retried=retried)

    def define(self, name: str, definition: str | None) -> str | None:
        key, meta = self._base(name) + "def", self._base(name) + "meta"

        def define() -> Any:
            pipe = self._client.pipeline(transaction=True)  # MULTI: definition and meta together
            if definition is not None:
                pipe.set(key, definition, nx=True)
                for field in ("epoch", "cursor", "token"):
                    pipe.hsetnx(meta, field, 0)
            pipe.get(key)
            return pipe.execute()[-1]

        stored = self._call(define)
        return None if stored is None else stored.decode()

    def acquire(
        self, name: str, worker: str, *, lease_timeout: float, num_shards: int, num_epochs: int | None
    ) -> Grant | Wait | None:
        reply = self._run("acquire", name, worker, repr(lease_timeout), num_shards, -1 if num_epochs is None else num_epochs)
        kind = reply[0].decode()
        if kind == "grant":
            return Grant(*(int(x) for x in reply[1:5]))
        if kind == "wait":
            return Wait(float(reply[1]))
        return None

    def report(
        self, name: str, *, epoch: int, slot: int, token: int, consumed: int, lease_timeout: float
    ) -> tuple[Status, str | None]:
        status, worker = self._run("report", name, epoch, slot, token, consumed, repr(lease_timeout))
        return Status(status.decode()), worker.decode() or None

    def complete(self, name: str, *, epoch: int, slot: int, token: int) -> tuple[Status, str | None]:
        retried: list[bool] = []
        status, worker = self._run("complete", name, epoch, slot, token, retried=retried)
        if retried and status == b"done":
            log.info("%s: complete of slot %d landed before the connection broke", self._url, slot)
            return Status.OK, None
        return Status(status.decode()), worker.decode() or None

    def heartbeat(self, name: str, worker: str, *, lease_timeout: float) -> int:
        return int(self._run("heartbeat", name, worker, repr(lease_timeout)))

    def release(self, name: str, worker: str) -> int | None:
        count = int(self._run("release", name, worker))
        return None if count < 0 else count

    def snapshot(self, name: str) -> dict[str, Any]:
        (epoch, cursor, token), queued, positions, leases, deadlines, stats = self._run("snapshot", name)
        workers: dict[str, list[int]] = {}
        for i in range(0, len(stats), 2):
            kind, worker = stats[i].decode().split(":", 1)
            workers.setdefault(worker, [0, 0])[0 if kind == "a" else 1] = int(stats[i + 1])
        table: dict[str, Any] = {}
        for i in range(0, len(leases), 2):
            held, consumed, worker = leases[i + 1].decode().split("|", 2)
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
        self._run("restore", name, json.dumps(state))

    def _request_id(self) -> str:
        """Unique per call (kept across its retries), to recognise a retried call that landed."""
        return f"{self._instance}-{os.getpid()}-{next(self._requests)}"

    def publish(self, kind: str, source: str, payload: str, *, keep: int) -> int:
        script, key = self._scripts["publish"], self._prefix + "{events}:"
        args = [source, kind, payload, keep, self._request_id()]
        return int(self._call(lambda: script(keys=[key], args=args)))

    def events(self, since: int, limit: int | None) -> list[Event]:
        key = self._prefix + "{events}:elog"
        page = () if limit is None else (0, limit)
        rows = self._call(lambda: self._client.zrangebyscore(key, f"({since}", "+inf", *page))
        events: list[Event] = []
        for row in rows:
            seq, at, source, kind, payload = json.loads(row)
            events.append((int(seq), float(at), source, kind, payload))
        return events

    def close(self) -> None:
        self._client.close()
