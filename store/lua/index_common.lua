-- index_common.lua: helpers every prefix-index script shares; store/index_store.py prepends it to each.
-- KEYS (identical for every index script, built by store/index_store.py):
--   KEYS[1] kvg:{m}:idx:<worker> ZSET block hash (16 hex) -> last use (ms)   KEYS[2] kvg:{m}:idx-workers SET
--   KEYS[3] kvg:{m}:idx:log STREAM of ops                                    KEYS[4] kvg:{m}:idx-seq counter
-- ARGV[1] worker   ARGV[2] log maxlen (each script's own ARGV follow)
-- returns: nothing (a prelude). Each change is logged as one stream entry with a dense sequence number
-- (`seq`), so a reader can tell that entries it never saw were trimmed away. Commands taking many
-- arguments are sent in chunks (Lua's unpack() has a limit of a few thousand values).
local function log(op, hashes)
  local seq = redis.call('INCR', KEYS[4])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*',
             'op', op, 'worker', ARGV[1], 'hashes', hashes, 'seq', seq)
end
local function chunked(cmd, key, first, step)
  local n, done = #ARGV, 0
  for i = first, n, step do
    done = done + redis.call(cmd, key, unpack(ARGV, i, math.min(i + step - 1, n)))
  end
  return done
end
