-- snapshot.lua: the model's admission state after reaping and granting (metrics, tests, audits).
-- KEYS: see common.lua.   ARGV[1] now_ms   ARGV[2] grants channel
-- returns {used_flat, quota_flat, {queued low, normal, high}, leases, hold_ms, now_ms, granted_ids}
reap()
local granted = pump()
publish(granted)
local queued = {}
for b = 0, 2 do queued[b + 1] = redis.call('ZCARD', qkey(b)) end
return {redis.call('HGETALL', K_USED), redis.call('HGETALL', K_QUOTA), queued,
        redis.call('ZCARD', K_LEASES), hold_ms(), int(NOW), granted}
