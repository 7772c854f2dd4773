-- index_clear.lua: drop every entry of one worker (restart, cache reset, deregistration).
-- KEYS: see index_common.lua
-- ARGV[1] worker  ARGV[2] log maxlen
-- returns the number of entries dropped
local n = redis.call('ZCARD', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
log('clear', '')
return n
