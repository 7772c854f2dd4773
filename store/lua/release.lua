-- release.lua: end a request wherever it is: drop its lease, or take it out of the queue (a waiter
-- that gave up or was cancelled), then grant the freed seats. Idempotent.
-- KEYS: see common.lua; with the lease's worker (two-step admission), KEYS[14] is its HASH
-- ARGV[1] now_ms   ARGV[2] grants channel   ARGV[3] request id   ARGV[4] model (with KEYS[14])
-- returns {code, hold_ms, granted_ids}; code: 1 lease released, 2 left the queue, 0 unknown (already
-- released, expired, or never admitted). When the release takes the lease's worker from full to one
-- free place, it PUBLISHes {"freed": model, "worker": id} on the channel (requests waiting for a
-- worker in any gateway try again).
local rid = ARGV[3]
reap()
local code = 0
local l = drop_lease(rid)
if l then
  code = 1
  if l.k and l.k ~= '' and KEYS[14] then
    local cap = tonumber(redis.call('HGET', KEYS[14], 'max_concurrency')) or 0
    if cap > 0 and used('wreq:' .. l.k) == cap - 1 then
      redis.call('PUBLISH', CHANNEL, cjson.encode({freed = ARGV[4], worker = l.k}))
    end
  end
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
