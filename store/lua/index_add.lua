-- index_add.lua: record that a worker holds some blocks, then trim it to its capacity (LRU first).
-- KEYS: see index_common.lua
-- ARGV[1] worker  ARGV[2] log maxlen  ARGV[3] capacity (blocks)  ARGV[4] hashes (comma-separated hex)
-- ARGV[5..] score, member pairs for ZADD
-- returns the number of blocks evicted by the capacity trim (they are logged as a remove)
chunked('ZADD', KEYS[1], 5, 1000)
redis.call('SADD', KEYS[2], ARGV[1])
log('add', ARGV[4])
local excess = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[3])
if excess <= 0 then return 0 end
local evicted = redis.call('ZRANGE', KEYS[1], 0, excess - 1)
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1)
log('remove', table.concat(evicted, ','))
return excess
