"""The Lua scripts of the Redis store: every operation is one script, atomic on the server.

Per data set (keys share the hash tag ``{name}`` under the key prefix): ``meta`` (epoch,
cursor, token counter), ``queue`` (returned slots, front first) with ``qpos`` (their
positions), ``lease`` (slot -> ``token|consumed|worker|request``, ``request`` being the
call that took the lease, so that an acquire retried after its reply was lost gets back
the leases its first attempt took instead of taking more), ``dl`` (a sorted set of leased
slots by deadline, so reclaiming expired leases is a range query), ``w:WORKER`` (a
worker's slots, for heartbeat, release and retries), ``hist`` (slot -> ``step|before``: the step a
lease's position was reported at and ``step:consumed`` of its report at the step before, if
any; dropped with the lease), ``completed`` (``epoch:slot`` -> ``epoch|step|consumed|`` and its ``hist``
entry: a shard completed at a step and its last reported positions, until a report two steps later) and ``stats`` (per worker ``c:``
completed and ``l:`` lost: leases that expired or were released; a worker's acquired
count is completed + lost + held, so taking a lease writes no counter).
Deadlines use the server clock (``TIME``), so worker clocks need not agree.

Each script reads ``meta`` once; a lease moves its counters with ``HINCRBY``. The hot path
(complete one shard, lease the next) is 15 Redis calls. Slots travel to Redis as the strings they
arrived as: a Lua number passed to ``redis.call`` is formatted again on every call, and
the hot path names a slot nine times.
The transitions mirror ``_table.LeaseTable`` (a differential test keeps them equal).
"""

from __future__ import annotations

__all__ = ["SCRIPTS"]

_PRELUDE = """
local base = KEYS[1]
local meta, queue, qpos, lease, dl, stats, hist, completed =
  base..'meta', base..'queue', base..'qpos', base..'lease', base..'dl', base..'stats', base..'hist', base..'completed'
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
-- a lease's info: its token (a number), consumed (a string), worker and request
local function parse(info)
  local token, consumed, worker, request = string.match(info, '^(%d+)|(%d+)|(.*)|([^|]*)$')
  return tonumber(token), consumed, worker, request
end
-- the data set's keys are gone (a server restarted empty, keys deleted): the client names it
local function gone()
  error({err = 'NODATASET ' .. base})
end
-- the data set's position (epoch, cursor into the epoch's order), read once per script;
-- acquire keeps it and meta in step
local function position()
  local p = redis.call('HMGET', meta, 'epoch', 'cursor')
  if not p[1] then gone() end
  return {epoch = tonumber(p[1]), cursor = tonumber(p[2])}
end
-- slot (a string) no longer leased by worker
local function drop(slot, worker)
  redis.call('HDEL', lease, slot)
  redis.call('HDEL', hist, slot)
  redis.call('ZREM', dl, slot)
  redis.call('SREM', base..'w:'..worker, slot)
end
-- a lease given up without completing: back to the front of the queue
local function give_back(slot)
  local _, consumed, worker = parse(redis.call('HGET', lease, slot))
  drop(slot, worker)
  redis.call('LPUSH', queue, slot)
  redis.call('HSET', qpos, slot, consumed)
  redis.call('HINCRBY', stats, 'l:'..worker, 1)
end
-- status of lease (epoch, slot, token), its holder, and its lease info when held
-- (slot: a string)
local function check(pos, epoch, slot, token)
  if epoch < pos.epoch then return 'done', '' end
  if epoch > pos.epoch then return 'unknown', '' end
  local info = redis.call('HGET', lease, slot)
  if info then
    local held, _, worker = parse(info)
    if held == token then return 'ok', worker, info end
    return 'held', worker
  end
  if redis.call('HEXISTS', qpos, slot) == 1 then return 'returned', '' end
  if tonumber(slot) < pos.cursor then return 'done', '' end
  return 'unknown', ''
end
local function finish(slot, worker)
  drop(slot, worker)
  redis.call('HINCRBY', stats, 'c:'..worker, '1')
end
-- a holder reports step (a number): completions no read as of a step needs any more go
-- (as _table.LeaseTable._forget_completions)
local function forget_completions(step)
  local flat = redis.call('HGETALL', completed)
  for i = 1, #flat, 2 do
    local at = tonumber(string.match(flat[i + 1], '^%d+|(%d+)|'))
    if at < step or at > step + 2 then redis.call('HDEL', completed, flat[i]) end
  end
end
-- on a retry: the grants that this request took and the worker still holds, in order
local function granted_before(pos, worker, request)
  local grants = {}
  for _, slot in ipairs(redis.call('SMEMBERS', base..'w:'..worker)) do
    local token, consumed, _, took = parse(redis.call('HGET', lease, slot))
    if took == request then grants[#grants + 1] = {'grant', pos.epoch, tonumber(slot), tonumber(consumed), token} end
  end
  table.sort(grants, function(a, b) return a[5] < b[5] end)
  return grants
end
-- expired leases back to the front of the queue, the earliest deadline first
local function reclaim(now)
  local flat = redis.call('ZRANGEBYSCORE', dl, '-inf', now, 'WITHSCORES')
  if #flat == 0 then return end
  local expired = {}
  for i = 1, #flat, 2 do expired[#expired + 1] = {tonumber(flat[i + 1]), tonumber(flat[i]), flat[i]} end
  table.sort(expired, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
  for i = #expired, 1, -1 do give_back(expired[i][3]) end
end
-- one lease for worker (after reclaim(now)). Counters move by HINCRBY with a constant:
-- writing a Lua number formats it (sprintf), the slowest part of a short script
local function acquire(pos, worker, request, timeout, num_shards, num_epochs, now)
  local slot, consumed  -- strings
  local front = redis.call('LPOP', queue)
  if front then
    slot, consumed = front, redis.call('HGET', qpos, front)
    redis.call('HDEL', qpos, front)
  elseif pos.cursor < num_shards then
    slot, consumed = string.format('%d', pos.cursor), '0'
    pos.cursor = redis.call('HINCRBY', meta, 'cursor', '1')
  elseif redis.call('HLEN', lease) > 0 then
    local first = redis.call('ZRANGE', dl, 0, 0, 'WITHSCORES')
    return {'wait', tostring(math.max(0, tonumber(first[2]) - now))}
  elseif num_epochs >= 0 and pos.epoch + 1 >= num_epochs then
    return {'none'}
  else
    slot, consumed, pos.epoch, pos.cursor = '0', '0', pos.epoch + 1, 1
    redis.call('HSET', meta, 'epoch', pos.epoch, 'cursor', '1')
  end
  local token = redis.call('HINCRBY', meta, 'token', '1')
  redis.call('HSET', lease, slot, token..'|'..consumed..'|'..worker..'|'..request)
  redis.call('ZADD', dl, now + timeout, slot)
  redis.call('SADD', base..'w:'..worker, slot)
  return {'grant', pos.epoch, tonumber(slot), tonumber(consumed), token}
end
"""

# ARGV: worker, lease_timeout, num_shards, num_epochs (-1: endless), count, request id, retry (0/1), then
# epoch, slot, token of each lease to complete. Completes them in order; only if every
# one succeeds, acquires for the worker up to count times (stopping after an answer that
# is not a grant). Reply: {n, status, holder (n times), the acquires' replies...}
_COMPLETE_ACQUIRE = """
local worker, count, request = ARGV[1], tonumber(ARGV[5]), ARGV[6]
local n = (#ARGV - 7) / 3
local reply = {n}
local pos = position()
if ARGV[7] == '1' then
  local again = granted_before(pos, worker, request)
  if again[1] then
    for _ = 1, n do reply[#reply + 1] = 'ok'; reply[#reply + 1] = worker end
    for _, grant in ipairs(again) do for _, v in ipairs(grant) do reply[#reply + 1] = v end end
    return reply
  end
end
local accepted = true
for i = 8, #ARGV, 3 do
  local slot = ARGV[i + 1]
  local status, holder = check(pos, tonumber(ARGV[i]), slot, tonumber(ARGV[i + 2]))
  if status == 'ok' then finish(slot, holder) else accepted = false end
  reply[#reply + 1] = status
  reply[#reply + 1] = holder
end
if accepted then
  local now = clock()
  local timeout, num_shards, num_epochs = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  reclaim(now)
  for _ = 1, count do
    local got = acquire(pos, worker, request, timeout, num_shards, num_epochs, now)
    for _, v in ipairs(got) do reply[#reply + 1] = v end
    if got[1] ~= 'grant' then break end
  end
end
return reply
"""

_REPORT = """
local epoch, slot, token = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local consumed, timeout, step = ARGV[4], tonumber(ARGV[5]), ARGV[6]
local status, worker, info = check(position(), epoch, slot, token)
if status == 'ok' then
  local _, was, _, request = parse(info)
  if step == '' then
    redis.call('HDEL', hist, slot)
  else  -- hist: slot -> step|before ('' or step:consumed), of the lease held now (drop() removes it)
    forget_completions(tonumber(step))
    local at, before = '-1', ''
    local h = redis.call('HGET', hist, slot)
    if h then at, before = string.match(h, '^(-?%d+)|(.*)$') end
    if step ~= at then before = at..':'..was end
    redis.call('HSET', hist, slot, step..'|'..before)
  end
  redis.call('HSET', lease, slot, token..'|'..consumed..'|'..worker..'|'..request)
  redis.call('ZADD', dl, clock() + timeout, slot)
end
return {status, worker}
"""

_COMPLETE = """
local epoch, slot, token, step = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4]
local status, worker, info = check(position(), epoch, slot, token)
if status == 'ok' then
  if step ~= '' then  -- consumed whole at step: keep its last reported positions
    local _, consumed = parse(info)
    redis.call('HSET', completed, ARGV[1]..':'..slot,
               ARGV[1]..'|'..step..'|'..consumed..'|'..(redis.call('HGET', hist, slot) or '-1|'))
  end
  finish(slot, worker)
end
return {status, worker}
"""

_HEARTBEAT = """
local worker, timeout = ARGV[1], tonumber(ARGV[2])
redis.call('HSETNX', stats, 'c:'..worker, 0)  -- known from now on
local slots = redis.call('SMEMBERS', base..'w:'..worker)
local deadline = clock() + timeout
for _, slot in ipairs(slots) do redis.call('ZADD', dl, 'XX', deadline, slot) end
return #slots
"""

_RELEASE = """
local worker = ARGV[1]
local slots = redis.call('SMEMBERS', base..'w:'..worker)
if #slots == 0 and redis.call('HEXISTS', stats, 'c:'..worker) == 0
   and redis.call('HEXISTS', stats, 'l:'..worker) == 0 then
  return -1  -- never acquired nor heartbeated
end
table.sort(slots, function(a, b) return tonumber(a) < tonumber(b) end)
for i = #slots, 1, -1 do give_back(slots[i]) end
return #slots
"""

_SNAPSHOT = """
local m = redis.call('HMGET', meta, 'epoch', 'cursor', 'token')
if not m[1] then gone() end
local now = clock()
local queued = redis.call('LRANGE', queue, 0, -1)
local positions = {}
for i, slot in ipairs(queued) do positions[i] = redis.call('HGET', qpos, slot) end
local leases = redis.call('HGETALL', lease)
local deadlines = {}
for i = 1, #leases, 2 do deadlines[#deadlines + 1] = tostring(redis.call('ZSCORE', dl, leases[i]) - now) end
return {m, queued, positions, leases, deadlines, redis.call('HGETALL', stats), redis.call('HGETALL', hist),
        redis.call('HGETALL', completed)}
"""

_RESTORE = """
local state = cjson.decode(ARGV[1])
local leases = redis.call('HGETALL', lease)
for i = 2, #leases, 2 do
  local _, _, worker = parse(leases[i])
  redis.call('DEL', base..'w:'..worker)
end
redis.call('DEL', queue, qpos, lease, dl, stats, hist, completed)
redis.call('HSET', meta, 'epoch', state['epoch'], 'cursor', state['cursor'])
for _, entry in ipairs(state['queue']) do
  redis.call('RPUSH', queue, entry[1])
  redis.call('HSET', qpos, entry[1], entry[2])
end
for worker, counts in pairs(state['workers']) do
  redis.call('HSET', stats, 'c:'..worker, counts[2], 'l:'..worker, counts[1] - counts[2])  -- no lease held
end
return 1
"""

# ARGV: definition ('' only reads). Definition and a fresh meta in one step; a meta that is
# there already (restored after the server lost the data set) is kept.
_DEFINE = """
local key = KEYS[1]..'def'
if ARGV[1] ~= '' and redis.call('SET', key, ARGV[1], 'NX') then
  for _, field in ipairs({'epoch', 'cursor', 'token'}) do redis.call('HSETNX', KEYS[1]..'meta', field, 0) end
end
return redis.call('GET', key)
"""

# The job-wide event log, under its own key base (hash tag {events}): ``eseq`` the counter,
# ``elog`` a sorted set of JSON [seq, time, source, kind, payload] by seq, ``ereq`` each
# source's last request id and seq, so a publish retried after a lost reply is not
# appended twice. ARGV: source, kind, payload, keep, request id.
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

#: operation -> Lua source (the lease operations share the prelude)
SCRIPTS: dict[str, str] = {
    **{
        op: _PRELUDE + body
        for op, body in {
            "complete_acquire": _COMPLETE_ACQUIRE,
            "report": _REPORT,
            "complete": _COMPLETE,
            "heartbeat": _HEARTBEAT,
            "release": _RELEASE,
            "snapshot": _SNAPSHOT,
            "restore": _RESTORE,
        }.items()
    },
    "define": _DEFINE,
    "publish": _PUBLISH,
}
