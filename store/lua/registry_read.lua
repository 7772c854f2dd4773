-- registry_read.lua: every registered worker of one model with its record, in one round trip.
-- KEYS[1] kvg:{m}:workers
-- ARGV[1] worker-hash key prefix (kvg:{m}:worker:, same hash tag)
-- returns a flat list: id, lease expiry, {field, value, ...} per worker (a lease without a record is skipped)
local out = {}
local ids = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #ids, 2 do
  local rec = redis.call('HGETALL', ARGV[1] .. ids[i])
  if #rec > 0 then
    table.insert(out, ids[i]); table.insert(out, ids[i + 1]); table.insert(out, rec)
  end
end
return out
