-- acquire.lua: admit one request now, queue it, or reject it (one round trip when a slot is free).
-- KEYS: see common.lua.   ARGV[1] now_ms   ARGV[2] grants channel   ARGV[3] request id
-- ARGV[4] band (0 low, 1 normal, 2 high)   ARGV[5] tenant   ARGV[6] seats   ARGV[7] lease_ms
-- ARGV[8] max_wait_ms (0 = do not wait)   ARGV[9] gateway id
-- ARGV[10] worker id chosen by routing ("" = none); with it, KEYS[14] is that worker's HASH
-- ARGV[11] "1" = reclaim: a running request's lease that Redis lost (restart) taken back; it alone is
--          admitted while the quota is recovering (common.lua: RECOVERING)
-- The request joins its band queue with its fair tag, then the pump runs: so it is admitted at once
-- only if no waiter with precedence can use the seats.
-- returns {code, seats, ahead, hold_ms, capacity, now_ms, granted_ids}; code:
--   1 admitted (lease held)  2 queued (wait for a grant on the channel)  3 already held  4 already queued
--  -1 rejected: no seat free and max_wait_ms = 0   -2 rejected: the band queue is full
--  -3 the chosen worker is full (step two of two-step admission; nothing was taken or queued): route
--     to another worker, or acquire without one, wait, and place it after the grant (claim.lua)
--  -4 refused: the model has no quota hash (Redis lost it); nothing was taken or queued
local rid, b, t = ARGV[3], tonumber(ARGV[4]), ARGV[5]
local lease_ms, max_wait_ms, gateway = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local worker = ARGV[10] or ''
local reclaim = ARGV[11] == '1'
reap()

local function reply(code, s, ahead, granted)
  publish(granted)
  return {code, s, ahead, hold_ms(), capacity(), int(NOW), granted}
end

if redis.call('ZSCORE', K_LEASES, rid) then return reply(3, 0, 0, pump()) end
if redis.call('HEXISTS', K_WAITER, rid) == 1 then return reply(4, 0, 0, pump()) end

if QUOTA_MISSING then return reply(-4, 0, 0, {}) end
local s = clamp_seats(tonumber(ARGV[6]), b, t)
if worker ~= '' and worker_full(worker) then return reply(-3, s, 0, pump()) end
local vtime = tonumber(redis.call('HGET', K_QSTATE, 'vtime:' .. b)) or 0
-- fast path: no waiter anywhere and the seats fit. Same end state as queueing then granting at once
-- (the band's tag table is empty when its queue is, so the tag is vtime + s), in a third of the calls.
local nobody_waits = redis.call('EXISTS', qkey(0), qkey(1), qkey(2)) == 0
if (reclaim or (nobody_waits and not RECOVERING)) and tenant_ok(t, s) and band_ok(b, s) and total_ok(s) then
  local l = {s = s, b = b, t = t, g = NOW, w = gateway, k = worker}
  redis.call('ZADD', K_LEASES, int(NOW + lease_ms), rid)
  redis.call('HSET', K_LEASE, rid, cjson.encode(l))
  add_usage(l, 1)
  redis.call('HSET', K_QSTATE, 'vtime:' .. b, int(vtime + s), 'since:' .. b, int(NOW))
  return reply(1, s, 0, {})
end
local q = qkey(b)
local was_empty = redis.call('ZCARD', q) == 0
local prev_tag = tonumber(redis.call('HGET', tagkey(b), t))
local tag = math.max(vtime, prev_tag or 0) + s
redis.call('ZADD', q, int(tag), rid)
redis.call('HSET', K_WAITER, rid, cjson.encode({s = s, b = b, t = t, l = lease_ms, w = gateway, k = worker}))
redis.call('ZADD', K_DEADLINE, int(NOW + math.max(max_wait_ms, 0)), rid)
redis.call('HSET', tagkey(b), t, int(tag))
if was_empty then redis.call('HSET', K_QSTATE, 'since:' .. b, int(NOW)) end

local granted, admitted = {}, false
for _, g in ipairs(pump()) do
  if g == rid then admitted = true else granted[#granted + 1] = g end
end
if admitted then return reply(1, s, 0, granted) end

local ahead = ahead_of(rid, b)
local full = redis.call('ZCARD', q) - 1 >= queue_max(b)
if max_wait_ms <= 0 or full then
  leave_queue(rid)
  if redis.call('ZCARD', q) > 0 then
    if prev_tag then redis.call('HSET', tagkey(b), t, int(prev_tag)) else redis.call('HDEL', tagkey(b), t) end
  end
  if max_wait_ms <= 0 then return reply(-1, s, ahead, granted) end
  return reply(-2, s, ahead, granted)
end
-- a queued request is placed on a worker after its grant, when the gateway routes it again
redis.call('HSET', K_WAITER, rid, cjson.encode({s = s, b = b, t = t, l = lease_ms, w = gateway, k = ''}))
return reply(2, s, ahead, granted)
