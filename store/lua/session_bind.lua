-- session_bind.lua: bind a client's session to the worker its request was routed to, for ttl_ms idle.
-- KEYS[1] kvg:{m}:session:<id>
-- ARGV[1] worker id   ARGV[2] the request's prompt tokens   ARGV[3] ttl_ms   ARGV[4] now_ms
-- returns the worker the session was bound to before ('' when it had no binding): it moved if different
-- One call writes the binding and its expiry together, so no binding ever lives without a TTL.
local before = redis.call('HGET', KEYS[1], 'worker') or ''
redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'tokens', ARGV[2], 'at_ms', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return before
