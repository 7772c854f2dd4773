"""Static workers: registered from their /v1/models, renewed only while /health answers."""

from __future__ import annotations

import redis.asyncio as aioredis

from agent import registry
from plugin.mirror import wall_ms
from plugin.static_workers import StaticWorkers, static_worker_id
from tests.e2e.harness import SseUpstream


def test_worker_id_from_url() -> None:
    assert static_worker_id("http://10.0.0.1:8000") == "static-10.0.0.1-8000"
    assert static_worker_id("gpu-3.local") == "static-gpu-3.local-80"


async def test_registered_while_healthy_then_left_to_expire(redis: aioredis.Redis) -> None:
    upstream = await SseUpstream("served-model").start()
    workers = StaticWorkers(redis, [upstream.url], period_s=60, lease_periods=4)  # ticks by hand
    await workers.start()  # first tick registers, with the model from the worker's /v1/models
    try:
        [record] = await registry.read_workers(redis, "served-model", wall_ms())
        assert record.id == static_worker_id(upstream.url) and record.url == upstream.url and record.live
        first_expiry = record.lease_expiry_ms
        await workers.tick()
        [renewed] = await registry.read_workers(redis, "served-model", wall_ms())
        assert renewed.lease_expiry_ms >= first_expiry
        await upstream.close()  # /health stops answering: no more renewals
        await workers.tick()
        [after] = await registry.read_workers(redis, "served-model", wall_ms())
        assert after.lease_expiry_ms == renewed.lease_expiry_ms
        assert not (await registry.read_workers(redis, "served-model", after.lease_expiry_ms + 1))[0].live
    finally:
        await workers.close()
        await upstream.close()
