-- quota.lua: re-assert the configured quota of one model (every gateway, on every mirror refresh).
-- Standalone (not prepended with common.lua). KEYS[1] kvg:{m}:quota
-- ARGV[1] digest of the configured limits (sha1 of the sorted "field=value" lines, plugin/quotas.py)
-- ARGV[2] the writing gateway's id   ARGV[3] recovery grace (ms) after a missing hash is written
-- ARGV[4..] field, value pairs of the configured limits
-- Meta fields kept in the hash beside the limits: v (version: server ms of the last write),
-- origin ("config" or "operator"), digest (of the limits as last written by a gateway), by (gateway),
-- recover_until (server ms; written with a missing hash: until then only reclaims are admitted, so the
-- running requests whose leases Redis lost are counted again before anyone new gets a seat).
-- A run-time change (an operator's HSET of a limit) makes the limits differ from `digest`: the hash
-- is then marked origin=operator and kept, by every gateway, until an operator deletes the hash.
-- returns {code, version}: 0 unchanged, 1 written (the hash was missing: Redis restarted or the key
-- was deleted), 2 replaced (the configured limits changed), 3 kept (a run-time change stands)
local META = {v = true, origin = true, digest = true, by = true, recover_until = true}
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))

local function write(code)
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'v', now, 'origin', 'config', 'digest', ARGV[1], 'by', ARGV[2], unpack(ARGV, 4))
  if code == 1 and tonumber(ARGV[3]) > 0 then
    redis.call('HSET', KEYS[1], 'recover_until', string.format('%d', tonumber(now) + tonumber(ARGV[3])))
  end
  return {code, now}
end

local flat = redis.call('HGETALL', KEYS[1])
if #flat == 0 then return write(1) end
local h, lines = {}, {}
for i = 1, #flat, 2 do
  h[flat[i]] = flat[i + 1]
  if not META[flat[i]] then lines[#lines + 1] = flat[i] .. '=' .. flat[i + 1] end
end
table.sort(lines)
if h['origin'] == 'operator' then return {3, h['v'] or '0'} end
if h['digest'] ~= redis.sha1hex(table.concat(lines, '\n')) then
  redis.call('HSET', KEYS[1], 'origin', 'operator', 'v', now)
  return {3, now}
end
if h['digest'] == ARGV[1] then return {0, h['v'] or '0'} end
return write(2)
