-- registry_register.lua: register (or re-register) a worker under one model, replacing its record.
-- KEYS[1] kvg:{m}:workers (ZSET id -> lease expiry ms)   KEYS[2] kvg:{m}:worker:<id> (HASH record)
-- ARGV[1] worker id   ARGV[2] lease expiry (ms)   ARGV[3] now (ms)   ARGV[4] url   ARGV[5..] field, value pairs
-- returns the worker's new epoch (incremented on every registration: its cache state is unknown), or
-- -1: the id is held by a live lease with another URL (refused: a second agent may not take it over)
local expiry = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '0')
local url = redis.call('HGET', KEYS[2], 'url')
if url and url ~= ARGV[4] and expiry > tonumber(ARGV[3]) then return -1 end
local epoch = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '0') + 1
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'epoch', epoch, unpack(ARGV, 5))
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return epoch
