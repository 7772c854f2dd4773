-- renew.lua: extend the leases one gateway holds for one model (one round trip per renewal period).
-- KEYS: see common.lua.   ARGV[1] now_ms   ARGV[2] grants channel   ARGV[3] lease_ms
-- ARGV[4..] request ids
-- returns {lost_ids, granted_ids}: lost = leases that had already expired (their seats are gone)
local lease_ms = tonumber(ARGV[3])
reap()
local lost = {}
for i = 4, #ARGV do
  if redis.call('ZSCORE', K_LEASES, ARGV[i]) then
    redis.call('ZADD', K_LEASES, int(NOW + lease_ms), ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
local granted = pump()
publish(granted)
return {lost, granted}
