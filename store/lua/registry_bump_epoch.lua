-- registry_bump_epoch.lua: start a new epoch (the worker restarted or cleared its cache).
-- KEYS[1] kvg:{m}:worker:<id>
-- ARGV: none
-- returns the new epoch, or 0 if the worker is not registered
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('HINCRBY', KEYS[1], 'epoch', 1)
