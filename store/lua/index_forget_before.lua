-- index_forget_before.lua: hit feedback (policy/feedback.py). A worker's engine reported fewer cached
-- tokens than the index expected, which proves its entries last used before a time stale: drop them,
-- except the reporting request's own blocks (its prefill cached them again). By score, in one step: an
-- entry some gateway re-added since that time (a newer score) stays.
-- KEYS: see index_common.lua
-- ARGV[1] worker  ARGV[2] log maxlen  ARGV[3] before (ms; entries scored below it go)  ARGV[4..] kept members
-- returns the number of entries dropped (logged as one remove)
local kept = {}
for i = 4, #ARGV do kept[ARGV[i]] = true end
local stale = {}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])) do
  if not kept[member] then stale[#stale + 1] = member end
end
if #stale == 0 then return 0 end
for i = 1, #stale, 1000 do
  redis.call('ZREM', KEYS[1], unpack(stale, i, math.min(i + 999, #stale)))
end
log('remove', table.concat(stale, ','))
return #stale
