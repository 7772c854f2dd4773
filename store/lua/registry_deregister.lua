-- registry_deregister.lua: remove a worker from a model's pool at once.
-- KEYS[1] kvg:{m}:workers   KEYS[2] kvg:{m}:worker:<id>
-- ARGV[1] worker id
-- returns {1 if the worker was registered else 0, workers left}
local existed = redis.call('ZREM', KEYS[1], ARGV[1]) + redis.call('DEL', KEYS[2])
if existed > 0 then existed = 1 end
return {existed, redis.call('ZCARD', KEYS[1])}
