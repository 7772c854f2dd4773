-- registry_set_field.lua: set one field of a registered worker's record (e.g. its drain flag).
-- KEYS[1] kvg:{m}:worker:<id>
-- ARGV[1] field   ARGV[2] value
-- returns 1 if the worker is registered and the field was set, else 0
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
