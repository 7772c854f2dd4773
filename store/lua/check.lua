-- check.lua: where is this request? Also grants seats freed by expired leases (the safety re-check
-- that covers lost pub/sub messages and crashed gateways).
-- KEYS: see common.lua.   ARGV[1] now_ms   ARGV[2] grants channel   ARGV[3] request id
-- returns {status, ahead, hold_ms, capacity, granted_ids}; status: 1 holds a lease, 2 queued,
-- 0 neither (its wait budget ran out, its lease expired, or it was never admitted)
local rid = ARGV[3]
reap()
local granted = pump()
publish(granted)
local status, ahead = 0, 0
if redis.call('ZSCORE', K_LEASES, rid) then
  status = 1
else
  local info = redis.call('HGET', K_WAITER, rid)
  if info then status = 2; ahead = ahead_of(rid, cjson.decode(info).b) end
end
return {status, ahead, hold_ms(), capacity(), granted}
