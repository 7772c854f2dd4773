-- common.lua: rules shared by every admission script; store/scripting.py prepends it to each one.
-- The same rules, as pure Python, are policy/admission.py (AdmissionState); tests prove they agree.
--
-- KEYS (identical for every admission script, built by store/scripts.py:model_keys; one hash tag):
--   KEYS[1]     kvg:{m}:quota     HASH  limits, read on every call (docs/ADMISSION.md); absent = refuse:
--                                       a missing hash (Redis restarted, key deleted) never means
--                                       unlimited; an unlimited model has a hash without `total`
--   KEYS[2]     kvg:{m}:leases    ZSET  request id -> lease expiry (ms)
--   KEYS[3]     kvg:{m}:lease     HASH  request id -> JSON {s seats, b band, t tenant, g granted_ms, w gateway,
--                                       k worker ('' = not placed yet)}
--   KEYS[4]     kvg:{m}:used      HASH  seats held by unexpired leases: total, band:<b>, tenant:<t>;
--                                       wreq:<worker> = requests placed on a worker (two-step admission)
--   KEYS[5..7]  kvg:{m}:queue:<b> ZSET  request id -> fair tag (b = 0 low, 1 normal, 2 high)
--   KEYS[8]     kvg:{m}:waiter    HASH  request id -> JSON {s, b, t, l lease_ms, w gateway}
--   KEYS[9]     kvg:{m}:deadline  ZSET  request id -> end of its wait budget (ms)
--   KEYS[10]    kvg:{m}:qstate    HASH  vtime:<b> (tag of the band's last grant), since:<b>, hold_ms
--   KEYS[11..13] kvg:{m}:tags:<b> HASH  tenant -> fair tag of its last queued request in band b
--   KEYS[14]    kvg:{m}:worker:<id> HASH (acquire and claim with a worker only) max_concurrency
-- ARGV[1] now_ms ("" or 0 = the Redis server's clock)   ARGV[2] pub/sub channel for grants
-- returns: nothing (a prelude; each script's header gives its own reply)
-- Every script first reaps expired leases and waiters (so counts only include live entries), does its
-- own work, then grants freed seats to waiters (pump) and PUBLISHes the granted request ids.

local K_QUOTA, K_LEASES, K_LEASE, K_USED = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_WAITER, K_DEADLINE, K_QSTATE = KEYS[8], KEYS[9], KEYS[10]
local function qkey(b) return KEYS[5 + b] end
local function tagkey(b) return KEYS[11 + b] end

local SCAN = 8           -- waiters looked at per band when the head's tenant or band is at its cap
local MAX_GRANTS = 64    -- grants per call, to bound script time
local DEFAULT_AGING_MS = 5000
local DEFAULT_QUEUE_MAX = 1024

local NOW
local SERVER_CLOCK = false  -- true when NOW is the Redis server's clock (a stall is measured on it)
do
  local n = tonumber(ARGV[1])
  if n and n > 0 then
    NOW = n
  else
    SERVER_CLOCK = true
    local t = redis.call('TIME')
    NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
end
local CHANNEL = ARGV[2]

local function int(x) return string.format('%d', x) end

local Q = {}
do
  local flat = redis.call('HGETALL', K_QUOTA)
  for i = 1, #flat, 2 do Q[flat[i]] = tonumber(flat[i + 1]) end
end
local AGING_MS = Q['aging_ms'] or DEFAULT_AGING_MS
-- no quota hash at all: nothing is admitted or granted until a gateway writes it again (quota.lua)
local QUOTA_MISSING = next(Q) == nil
-- a quota written again after it went missing (quota.lua: recover_until): until then the leases
-- Redis lost are being taken back by their gateways (acquire with reclaim), and nothing else is granted
local RECOVERING = (Q['recover_until'] or 0) > NOW
-- script calls further apart than this on the server clock mean Redis did not run (SIGSTOP, a stalled
-- host): the gap is not charged to the leases (gateways renew at least every renew_every_ms < this)
local STALL_MS = 2500

local function tenant_cap(t) return Q['tenant:' .. t] or Q['tenant'] end
local function queue_max(b) return Q['queue_max:' .. b] or Q['queue_max'] or DEFAULT_QUEUE_MAX end

local function used(field) return tonumber(redis.call('HGET', K_USED, field)) or 0 end
local function add_used(field, delta)
  if redis.call('HINCRBY', K_USED, field, delta) <= 0 then redis.call('HDEL', K_USED, field) end
end
local function add_usage(l, sign)
  add_used('total', sign * l.s)
  add_used('band:' .. l.b, sign * l.s)
  add_used('tenant:' .. l.t, sign * l.s)
  if l.k and l.k ~= '' then add_used('wreq:' .. l.k, sign) end
end

-- step two: the chosen worker's own capacity (max_concurrency from its agent; 0 or absent = unknown)
local function worker_full(worker)
  local cap = tonumber(redis.call('HGET', KEYS[14], 'max_concurrency')) or 0
  return cap > 0 and used('wreq:' .. worker) >= cap
end

-- seats of the total a request of band b must leave free: the largest reserve of a higher band
local function reserved_above(b)
  local r = 0
  for h = b + 1, 2 do r = math.max(r, Q['reserve:' .. h] or 0) end
  return r
end

-- a request's seats: at least 1, at most the smallest limit that applies, so it can always run eventually
local function clamp_seats(s, b, t)
  if Q['seats'] == 0 then return 1 end
  local cap = math.max(1, math.floor(s))
  local function lower(x) if x ~= nil and x >= 1 and x < cap then cap = x end end
  lower(Q['total'])
  lower(tenant_cap(t))
  if Q['band:' .. b] ~= nil then lower(Q['band:' .. b] + (Q['borrow:' .. b] or 0)) end
  local reserve = reserved_above(b)
  if Q['total'] ~= nil and reserve > 0 then lower(Q['total'] - reserve) end
  return math.floor(cap)
end

local function tenant_ok(t, s)
  local cap = tenant_cap(t)
  return cap == nil or used('tenant:' .. t) + s <= cap
end

-- leaves the seats higher bands reserve free, and is within its nominal seats, or borrowing (up to
-- borrow:<b>) seats that lower bands leave unused
local function band_ok(b, s)
  local reserve = reserved_above(b)
  if Q['total'] ~= nil and reserve > 0 and used('total') + s + reserve > Q['total'] then return false end
  local nominal = Q['band:' .. b]
  if nominal == nil then return true end
  local ub = used('band:' .. b)
  if ub + s <= nominal then return true end
  if ub + s > nominal + (Q['borrow:' .. b] or 0) then return false end
  local pool, used_pool = 0, 0
  for l = 0, b do
    local nl = Q['band:' .. l]
    if nl ~= nil then pool = pool + nl; used_pool = used_pool + used('band:' .. l) end
  end
  return used_pool + s <= pool
end

local function total_ok(s) return Q['total'] == nil or used('total') + s <= Q['total'] end

local function drop_lease(rid)
  local info = redis.call('HGET', K_LEASE, rid)
  redis.call('ZREM', K_LEASES, rid)
  if not info then return nil end
  redis.call('HDEL', K_LEASE, rid)
  local l = cjson.decode(info)
  add_usage(l, -1)
  return l
end

local function leave_queue(rid)
  redis.call('ZREM', K_DEADLINE, rid)
  local info = redis.call('HGET', K_WAITER, rid)
  if not info then return nil end
  redis.call('HDEL', K_WAITER, rid)
  local w = cjson.decode(info)
  redis.call('ZREM', qkey(w.b), rid)
  if redis.call('ZCARD', qkey(w.b)) == 0 then redis.call('DEL', tagkey(w.b)) end
  return w
end

-- Leases are charged only for time Redis was serving: after a stall, every lease is extended by the
-- gap before reaping, so the first calls after a pause do not free running requests' seats for
-- newcomers before their holders could renew (with an explicit now_ms, time is the caller's).
local function catch_up()
  if not SERVER_CLOCK then return end
  local seen = tonumber(redis.call('HGET', K_QSTATE, 'seen'))
  redis.call('HSET', K_QSTATE, 'seen', int(NOW))
  if seen == nil or NOW - seen <= STALL_MS then return end
  local live = redis.call('ZRANGE', K_LEASES, 0, -1, 'WITHSCORES')
  for i = 1, #live, 2 do redis.call('ZADD', K_LEASES, int(tonumber(live[i + 1]) + NOW - seen), live[i]) end
end

local function reap()
  catch_up()
  for _, rid in ipairs(redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', int(NOW))) do drop_lease(rid) end
  for _, rid in ipairs(redis.call('ZRANGEBYSCORE', K_DEADLINE, '-inf', int(NOW))) do leave_queue(rid) end
end

local function grant(rid, w, tag)
  leave_queue(rid)
  local l = {s = w.s, b = w.b, t = w.t, g = NOW, w = w.w, k = w.k or ''}
  redis.call('ZADD', K_LEASES, int(NOW + w.l), rid)
  redis.call('HSET', K_LEASE, rid, cjson.encode(l))
  add_usage(l, 1)
  redis.call('HSET', K_QSTATE, 'vtime:' .. w.b, int(tag), 'since:' .. w.b, int(NOW))
end

-- Grant seats to waiters while the best candidate fits. Each band offers its first waiter (fair-tag
-- order, among the first SCAN) whose tenant and band limits allow it; the band with the highest
-- effective priority (band + whole aging periods since it was last served) wins, ties to the band
-- served longest ago, then the higher band. If the winner does not fit the model total, nobody
-- behind it jumps ahead: the freed seats wait for it.
local function pump()
  local granted = {}
  if QUOTA_MISSING or RECOVERING then return granted end
  for _ = 1, MAX_GRANTS do
    local best = nil
    for b = 2, 0, -1 do
      local entries = redis.call('ZRANGE', qkey(b), 0, SCAN - 1, 'WITHSCORES')
      for i = 1, #entries, 2 do
        local rid = entries[i]
        local info = redis.call('HGET', K_WAITER, rid)
        local w = info and cjson.decode(info)
        if not w then
          redis.call('ZREM', qkey(b), rid)  -- a queue entry without its record: drop it
        elseif tenant_ok(w.t, w.s) and band_ok(b, w.s) then
          local since = tonumber(redis.call('HGET', K_QSTATE, 'since:' .. b)) or NOW
          local eff = b
          if AGING_MS > 0 then eff = b + math.floor((NOW - since) / AGING_MS) end
          if best == nil or eff > best.eff or (eff == best.eff and since < best.since) then
            best = {rid = rid, w = w, tag = tonumber(entries[i + 1]), eff = eff, since = since}
          end
          break
        end
      end
    end
    if best == nil or not total_ok(best.w.s) then break end
    grant(best.rid, best.w, best.tag)
    granted[#granted + 1] = best.rid
  end
  return granted
end

local function publish(granted)
  if #granted > 0 then redis.call('PUBLISH', CHANNEL, cjson.encode(granted)) end
end

-- waiters ahead of rid: earlier in its own band plus everyone in higher bands (for the wait estimate)
local function ahead_of(rid, b)
  local n = redis.call('ZRANK', qkey(b), rid) or 0
  for h = b + 1, 2 do n = n + redis.call('ZCARD', qkey(h)) end
  return n
end

local function hold_ms() return tonumber(redis.call('HGET', K_QSTATE, 'hold_ms')) or 0 end
local function capacity() return Q['total'] or -1 end
