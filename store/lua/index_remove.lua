-- index_remove.lua: record that a worker no longer holds some blocks.
-- KEYS: see index_common.lua
-- ARGV[1] worker  ARGV[2] log maxlen  ARGV[3] hashes (comma-separated hex)  ARGV[4..] members
-- returns the number of entries removed
local removed = chunked('ZREM', KEYS[1], 4, 1000)
log('remove', ARGV[3])
return removed
