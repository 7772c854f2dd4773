-- registry_prune.lua: remove workers whose lease expired before a cutoff.
-- KEYS[1] kvg:{m}:workers
-- ARGV[1] cutoff (ms)   ARGV[2] worker-hash key prefix (same hash tag)
-- returns the ids of the removed workers
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
for _, id in ipairs(gone) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('DEL', ARGV[2] .. id)
end
return gone
