"""The Lua scripts behind `RedisLimits`: Redis runs each one atomically (no other command of any
client runs in between), which is what makes one key's limits exact across every gateway that
shares the Redis server: read the windows, decide, charge, all in one step.

The rule is `tokenpath.gateway.limiter.decide`, the same one the SQL store applies, written once
more here because it has to run inside Redis; `tests/gateway/test_redis_limits.py` drives both
backends through the same scenarios so that they cannot drift apart silently.

Per scope (the key, then its tenant) four keys, all with the tenant in a `{hash tag}` so that on
a Redis Cluster they land on one slot, as a multi-key script requires:
- `win`  sorted set, admission id -> admission time (the sliding 60 s window of requests);
- `tok`  hash, admission id -> tokens (reserved, then the real use once reconciled);
- `sum`  the tokens of the admissions still in the window (kept so a check is O(1));
- `day`  the tokens charged to one UTC day of the gateway's clock (expires after two days).
Numbers travel as strings: Redis truncates Lua numbers in replies to integers.

Every script is idempotent per admission id (a reservation already charged is not charged again;
an adjust or a reconcile leaves a ten-minute marker, the adjust's holding its reply), so the client
may resend one after a dropped connection.
"""

from __future__ import annotations

# Shared by RESERVE and ADJUST: arguments, pruning, the usage snapshot, retry_after and the reply.
_WINDOWS = r"""
-- KEYS[4i-3..4i]: scope i's win, tok, sum, day.
-- ARGV: now, window_s, tokens, admission id, (script's own), n scopes, then rpm, tpm, daily per scope (-1: none).
-- Reply: decision ('ok', 'replay', 'too_large', 'requests', 'tokens', 'daily_tokens'), scope, retry_after,
--        then per scope the usage before this request: requests, tokens, oldest admission time, day tokens.
local now, window, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local id, n = ARGV[4], tonumber(ARGV[6])
local cutoff = string.format('%.6f', now - window)
local CHUNK = 500  -- unpack() has a stack limit: leave the window in batches

local function limit(i, k) return tonumber(ARGV[6 + 3 * (i - 1) + k]) end  -- k: 1 rpm, 2 tpm, 3 daily
local function key(i, k) return KEYS[4 * (i - 1) + k] end  -- k: 1 win, 2 tok, 3 sum, 4 day

local function prune(win, tok, sum)  -- admissions at or before now - window leave it
  while true do
    local old = redis.call('ZRANGEBYSCORE', win, '-inf', cutoff, 'LIMIT', 0, CHUNK)
    if #old == 0 then return end
    local freed = 0
    for _, t in ipairs(redis.call('HMGET', tok, unpack(old))) do freed = freed + (tonumber(t) or 0) end
    redis.call('ZREM', win, unpack(old))
    redis.call('HDEL', tok, unpack(old))
    redis.call('DECRBY', sum, freed)
  end
end

local function retry_after(i, more_requests, more_tokens)  -- oldest first, until enough has left
  local rows = redis.call('ZRANGE', key(i, 1), 0, -1, 'WITHSCORES')
  local freed_requests, freed_tokens = 0, 0
  for j = 1, #rows, 2 do
    freed_requests = freed_requests + 1
    freed_tokens = freed_tokens + (tonumber(redis.call('HGET', key(i, 2), rows[j])) or 0)
    if freed_requests >= more_requests and freed_tokens >= more_tokens then
      return math.max(0, tonumber(rows[j + 1]) + window - now)
    end
  end
  return window
end

local usage = {}
for i = 1, n do
  prune(key(i, 1), key(i, 2), key(i, 3))
  local first = redis.call('ZRANGE', key(i, 1), 0, 0, 'WITHSCORES')
  usage[i] = {redis.call('ZCARD', key(i, 1)), tonumber(redis.call('GET', key(i, 3)) or '0'),
              first[2] or '', tonumber(redis.call('GET', key(i, 4)) or '0')}
end

local function reply(decision, scope, retry)
  local out = {decision, tostring(scope), string.format('%.6f', retry)}
  for i = 1, n do
    local u = usage[i]
    table.insert(out, string.format('%d', u[1]))
    table.insert(out, string.format('%d', u[2]))
    table.insert(out, u[3])
    table.insert(out, string.format('%d', u[4]))
  end
  return out
end

local function refusal()  -- limiter.decide's rule over `usage`: nil when `tokens` fits every scope
  for i = 1, n do
    local tpm, daily = limit(i, 2), limit(i, 3)
    if (tpm >= 0 and tokens > tpm) or (daily >= 0 and tokens > daily) then return 'too_large', i, 0, 0 end
  end
  for i = 1, n do
    local u, rpm, tpm, daily = usage[i], limit(i, 1), limit(i, 2), limit(i, 3)
    if rpm >= 0 and u[1] + 1 > rpm then return 'requests', i, u[1] + 1 - rpm, 0 end
    if tpm >= 0 and u[2] + tokens > tpm then return 'tokens', i, 0, u[2] + tokens - tpm end
    if daily >= 0 and u[4] + tokens > daily then return 'daily_tokens', i, 0, 0 end
  end
  return nil
end
"""

RESERVE = _WINDOWS + r"""
-- ARGV[5]: day_ttl_s.
local day_ttl = tonumber(ARGV[5])
if redis.call('HEXISTS', key(1, 2), id) == 1 then  -- a retried call whose first attempt charged it
  return reply('replay', 0, 0)
end
local decision, scope, more_requests, more_tokens = refusal()
if decision then
  local retry = 0
  if decision == 'requests' or decision == 'tokens' then retry = retry_after(scope, more_requests, more_tokens) end
  return reply(decision, scope, retry)
end

local ttl_ms = math.ceil(window * 2000)  -- idle scopes vanish two windows after their last admission
for i = 1, n do
  redis.call('ZADD', key(i, 1), ARGV[1], id)
  redis.call('HSET', key(i, 2), id, tokens)
  redis.call('INCRBY', key(i, 3), tokens)
  redis.call('INCRBY', key(i, 4), tokens)
  for k = 1, 3 do redis.call('PEXPIRE', key(i, k), ttl_ms) end
  redis.call('EXPIRE', key(i, 4), day_ttl)
end
return reply('ok', 0, 0)
"""

ADJUST = _WINDOWS + r"""
-- Re-size admission `id` (reserved on an estimate) to `tokens`. ARGV[5]: the tokens it reserved;
-- KEYS[4n+1]: its "adjusted" marker, which keeps the first reply so that a resend returns it unchanged.
-- Reply as RESERVE's ('ok' or a refusal); when growing, the usage is without this admission.
local reserved, marker = tonumber(ARGV[5]), KEYS[4 * n + 1]
local done = redis.call('GET', marker)
if done then return cjson.decode(done) end

local held = {}  -- what the admission holds in each scope's window (nil: it has left the window)
for i = 1, n do held[i] = tonumber(redis.call('HGET', key(i, 2), id)) end

local function resize(to, day_delta)  -- `to`: the admission's new tokens, nil to take it out
  for i = 1, n do
    if held[i] then
      if to then redis.call('HSET', key(i, 2), id, to) else
        redis.call('ZREM', key(i, 1), id)
        redis.call('HDEL', key(i, 2), id)
      end
      redis.call('INCRBY', key(i, 3), (to or 0) - held[i])
    end
    if day_delta ~= 0 and redis.call('EXISTS', key(i, 4)) == 1 then redis.call('INCRBY', key(i, 4), day_delta) end
  end
end

local function finish(out)
  redis.call('SET', marker, cjson.encode(out), 'EX', 600)
  return out
end

if tokens > reserved then  -- growing: decided as if this admission were not in the window
  for i = 1, n do
    if held[i] then usage[i][1], usage[i][2] = usage[i][1] - 1, usage[i][2] - held[i] end
    usage[i][4] = usage[i][4] - reserved
  end
  local decision, scope, more_requests, more_tokens = refusal()
  if decision then  -- refused: the admission leaves the window and gives its day back
    resize(nil, -reserved)
    local retry = 0
    if decision == 'requests' or decision == 'tokens' then retry = retry_after(scope, more_requests, more_tokens) end
    return finish(reply(decision, scope, retry))
  end
end
resize(tokens, tokens - reserved)  -- shrinking always fits
return finish(reply('ok', 0, 0))
"""

RECONCILE = r"""
-- KEYS[3i-2..3i]: scope i's tok, sum, day; KEYS[3n+1]: this admission's "reconciled" marker.
-- ARGV: admission id, used, reserved, n scopes.
local id, used, reserved, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if not redis.call('SET', KEYS[3 * n + 1], '1', 'NX', 'EX', 600) then return 0 end  -- done already
for i = 1, n do
  local tok, sum, day = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local held = redis.call('HGET', tok, id)
  if held then  -- still in the window: it now holds the real use
    redis.call('HSET', tok, id, used)
    redis.call('INCRBY', sum, used - tonumber(held))
  end
  if used ~= reserved and redis.call('EXISTS', day) == 1 then redis.call('INCRBY', day, used - reserved) end
end
return 1
"""
