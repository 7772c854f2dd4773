"""Quota recovery after a Redis restart and leases across a Redis stall, against a real Redis
(store/lua/quota.lua recover_until, common.lua catch_up)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from plugin.quotas import assert_quota
from policy.admission import AdmitCode, Quota
from policy.types import Band
from store.scripts import model_keys, register_scripts


async def test_rewritten_quota_admits_only_reclaims_during_its_grace(redis: aioredis.Redis) -> None:
    scripts = register_scripts(redis)
    code, _ = await assert_quota(redis, "m", Quota(total=1), "gw", recover_ms=400)
    assert code == 1  # was missing
    args = ("m", "new", Band.NORMAL, "t", 1, 5_000, 0, "gw")
    assert (await scripts.acquire(*args)).code == AdmitCode.NO_SEAT  # recovering: not a newcomer
    reclaimed = await scripts.acquire("m", "running", Band.NORMAL, "t", 1, 5_000, 0, "gw", reclaim=True)
    assert reclaimed.code == AdmitCode.ADMITTED  # the running request's lease, taken back
    await asyncio.sleep(0.5)
    assert (await scripts.acquire(*args)).code == AdmitCode.NO_SEAT  # the quota (1) is held by it
    await scripts.release("m", "running")
    assert (await scripts.acquire(*args)).code == AdmitCode.ADMITTED
    await scripts.aclose()


async def test_a_stall_is_not_charged_to_leases(redis: aioredis.Redis) -> None:
    """Script calls further apart than STALL_MS (Redis did not run): leases are extended by the gap."""
    scripts = register_scripts(redis)
    await assert_quota(redis, "m", Quota(total=1), "gw")
    assert (await scripts.acquire("m", "a", Band.NORMAL, "t", 1, 10_000, 0, "gw")).code == AdmitCode.ADMITTED
    keys = model_keys("m")
    expiry = float(await redis.zscore(keys[1], "a") or 0)
    await redis.hset(keys[9], "seen", str(int(expiry) - 10_000 - 60_000))  # last call a minute ago
    await scripts.check("m", "a")
    assert float(await redis.zscore(keys[1], "a") or 0) >= expiry + 60_000
    await scripts.aclose()
