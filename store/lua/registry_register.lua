-- registry_register.lua: register (or re-register) a worker under one model, replacing its record.
-- KEYS[1] kvg:{m}:workers (ZSET id -> lease expiry ms)   KEYS[2] kvg:{m}:worker:<id> (HASH record)
-- ARGV[1] worker id   ARGV[2] lease expiry (ms)   ARGV[3..] field, value pairs
-- returns the worker's new epoch (incremented on every registration: its cache state is unknown)
local epoch = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '0') + 1
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'epoch', epoch, unpack(ARGV, 3))
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return epoch
