"""Session bindings in Redis (explicit session affinity, policy/session.py), shared by every gateway.

    kvg:{<model>}:session:<session id>   HASH worker, tokens (the last routed prompt), at_ms; PEXPIRE ttl

Lease discipline, as for slot leases: a binding is only ever written together with its expiry (one
script, store/lua/session_bind.lua), its TTL slides with each request of the session, the gateway
renews the bindings of sessions with requests in flight (`renew`), and a client's close removes it
at once (`close`). A gateway that dies leaks nothing: its bindings expire one TTL after their last
renewal. Session ids are validated by the gateway (1-128 of [A-Za-z0-9._:-]), so a key never
carries braces and every key of a model stays in its hash slot.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from policy.session import SessionBinding
from store.keys import model_key
from store.scripting import load


def session_key(model: str, session_id: str) -> str:
    return model_key(model, "session", session_id)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def lookup(redis: aioredis.Redis, model: str, session_id: str) -> SessionBinding | None:
    """The session's binding, or None (never bound, expired or closed)."""
    worker, tokens = await redis.hmget(session_key(model, session_id), ["worker", "tokens"])
    if not worker:
        return None
    try:
        count = int(_text(tokens)) if tokens is not None else 0
    except ValueError:  # written by hand: the binding still names the worker
        count = 0
    return SessionBinding(_text(worker), count)


async def bind(
    redis: aioredis.Redis, model: str, session_id: str, worker: str, tokens: int, ttl_ms: int, now_ms: int
) -> str:
    """Bind the session to `worker` for `ttl_ms`; returns the worker it was bound to before ('')."""
    script = load("session_bind.lua")
    before = await script(redis, [session_key(model, session_id)], [worker, max(0, tokens), ttl_ms, now_ms])
    return _text(before)


async def renew(redis: aioredis.Redis, sessions: Iterable[tuple[str, str]], ttl_ms: int) -> int:
    """Extend the TTL of (model, session id) bindings that still exist (PEXPIRE creates nothing), in one
    pipelined round trip; returns how many were extended."""
    pipe = redis.pipeline(transaction=False)
    count = 0
    for model, session_id in sessions:
        pipe.pexpire(session_key(model, session_id), ttl_ms)
        count += 1
    if not count:
        return 0
    return sum(1 for ok in await pipe.execute() if ok)


async def close(redis: aioredis.Redis, model: str, session_id: str) -> bool:
    """The client ended the session: drop its binding now. True if there was one."""
    return bool(await redis.delete(session_key(model, session_id)))
