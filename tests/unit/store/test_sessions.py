"""store/sessions.py on a real redis-server: bindings always carry a TTL, slide, renew and close."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from policy.session import SessionBinding
from store import sessions


async def test_bind_lookup_renew_close(redis: aioredis.Redis) -> None:
    assert await sessions.lookup(redis, "m", "s1") is None
    assert await sessions.bind(redis, "m", "s1", "w0", 1200, ttl_ms=5000, now_ms=1) == ""
    assert await sessions.lookup(redis, "m", "s1") == SessionBinding("w0", 1200)
    key = sessions.session_key("m", "s1")
    assert key == "kvg:{m}:session:s1"
    assert 0 < await redis.pttl(key) <= 5000  # written with its expiry
    assert await sessions.bind(redis, "m", "s1", "w1", 2400, ttl_ms=5000, now_ms=2) == "w0"  # moved
    assert await sessions.lookup(redis, "m", "s1") == SessionBinding("w1", 2400)
    await redis.pexpire(key, 100)
    assert await sessions.renew(redis, [("m", "s1"), ("m", "never")], ttl_ms=60_000) == 1
    assert await redis.pttl(key) > 50_000
    assert not await redis.exists(sessions.session_key("m", "never"))  # renewal creates nothing
    assert await sessions.close(redis, "m", "s1") is True
    assert await sessions.lookup(redis, "m", "s1") is None
    assert await sessions.close(redis, "m", "s1") is False


async def test_a_binding_expires_when_nobody_renews_it(redis: aioredis.Redis) -> None:
    await sessions.bind(redis, "m", "short", "w0", 10, ttl_ms=50, now_ms=1)
    await asyncio.sleep(0.2)
    assert await sessions.lookup(redis, "m", "short") is None
    assert await sessions.renew(redis, [("m", "short")], ttl_ms=1000) == 0
