"""Static workers: registered from their /v1/models, renewed only while /health answers."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from aiohttp import web

from plugin.mirror import wall_ms
from plugin.static_workers import StaticWorkers, static_worker_id
from store import registry
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


class SlowHealthWorker:
    """A worker whose /health can be made to hang (as it seems to a gateway whose loop is saturated)."""

    def __init__(self) -> None:
        self.hang = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app)
        self.url = ""

    async def start(self) -> SlowHealthWorker:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def _health(self, _: web.Request) -> web.Response:
        if self.hang.is_set():
            await asyncio.sleep(1)
        return web.Response(text="ok")

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "slow-model"}]})


async def test_timeouts_within_the_grace_keep_the_lease_then_it_runs_out(redis: aioredis.Redis) -> None:
    worker = await SlowHealthWorker().start()
    # a grace of two periods: the first timeout renews, the second does not
    workers = StaticWorkers(redis, [worker.url], period_s=60, health_timeout_s=0.1, slow_grace_s=120)
    await workers.start()
    try:
        [first] = await registry.read_workers(redis, "slow-model", wall_ms())
        worker.hang.set()
        await workers.tick()  # times out, but it answered moments ago: renewed
        [renewed] = await registry.read_workers(redis, "slow-model", wall_ms())
        assert renewed.lease_expiry_ms > first.lease_expiry_ms
        await workers.tick()  # past the grace: a timeout no longer renews
        [after] = await registry.read_workers(redis, "slow-model", wall_ms())
        assert after.lease_expiry_ms == renewed.lease_expiry_ms
    finally:
        await workers.close()
        await worker.runner.cleanup()
