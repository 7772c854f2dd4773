-- registry_heartbeat.lua: renew a worker's lease and write its latest load in one round trip.
-- KEYS[1] kvg:{m}:workers   KEYS[2] kvg:{m}:worker:<id>
-- ARGV[1] worker id   ARGV[2] lease expiry (ms)   ARGV[3..] field, value pairs (load)
-- returns -1 if the worker is not registered (the caller must register again), else its draining flag 0/1
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return tonumber(redis.call('HGET', KEYS[2], 'draining') or '0')
