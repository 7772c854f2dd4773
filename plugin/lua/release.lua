-- release.lua: end a request wherever it is: drop its lease, or take it out of the queue (a waiter
-- that gave up or was cancelled), then grant the freed seats. Idempotent.
-- KEYS: see common.lua.   ARGV[1] now_ms   ARGV[2] grants channel   ARGV[3] request id
-- returns {code, hold_ms, granted_ids}; code: 1 lease released, 2 left the queue, 0 unknown (already
-- released, expired, or never admitted)
local rid = ARGV[3]
reap()
local code = 0
local l = drop_lease(rid)
if l then
  code = 1
  local held = NOW - l.g
  local old = tonumber(redis.call('HGET', K_QSTATE, 'hold_ms'))
  local ewma = held
  if old then ewma = math.floor(old * 0.9 + held * 0.1) end
  redis.call('HSET', K_QSTATE, 'hold_ms', int(ewma))
elseif leave_queue(rid) then
  code = 2
end
local granted = pump()
publish(granted)
return {code, hold_ms(), granted}
