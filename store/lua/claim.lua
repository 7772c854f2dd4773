-- claim.lua: place a held lease on a worker (step two of two-step admission, for a request that was
-- granted after waiting and then routed). Placing it again on the same worker is a no-op.
-- KEYS: see common.lua; KEYS[14] kvg:{m}:worker:<id> (its max_concurrency)
-- ARGV[1] now_ms   ARGV[2] grants channel   ARGV[3] request id   ARGV[4] worker id
-- returns {code, granted_ids}; code: 1 placed, 0 no such lease (expired or released), -3 worker full
local rid, worker = ARGV[3], ARGV[4]
reap()
local code = 0
local info = redis.call('HGET', K_LEASE, rid)
if info then
  local l = cjson.decode(info)
  if l.k == worker then
    code = 1
  elseif worker_full(worker) then
    code = -3
  else
    if l.k and l.k ~= '' then add_used('wreq:' .. l.k, -1) end
    l.k = worker
    add_used('wreq:' .. worker, 1)
    redis.call('HSET', K_LEASE, rid, cjson.encode(l))
    code = 1
  end
end
local granted = pump()
publish(granted)
return {code, granted}
