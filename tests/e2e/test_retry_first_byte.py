"""Retry before the first byte with real processes: a worker that accepts the connection, reads the
request and resets it before any response byte (as one killed after accepting) gets no request
answered badly: each is routed again to the other worker, and every lease comes back once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from store import keys, registry
from store.registry import WorkerRecord
from tests.e2e.faults import RedisProcess, send
from tests.e2e.harness import Gateway, chat, gateways, poll, serve, start_worker

pytestmark = pytest.mark.e2e

MODEL = "m"


async def start_resetting_worker() -> tuple[web.AppRunner, str]:
    """A worker that reads each completion request and resets the connection without answering."""

    async def chat_handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        request.transport.abort()  # RST before the first response byte
        raise web.HTTPInternalServerError()  # never sent: the transport is gone

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat_handler)
    return await serve(app)


async def test_a_worker_reset_before_the_first_byte_is_routed_again(tmp_path: Path) -> None:
    proc = RedisProcess().start()
    broken, url_a = await start_resetting_worker()
    good, url_b = await start_worker(MODEL, "b")
    client = aioredis.Redis.from_url(proc.url)
    now = int(time.time() * 1000)
    for wid, url in (("a", url_a), ("b", url_b)):  # the test is their agent: long leases
        await registry.register(client, WorkerRecord(id=wid, model=MODEL, url=url), 120_000, now)
    config = tmp_path / "kvgate.toml"
    config.write_text(f'[models."{MODEL}"]\ntotal = 4\n[routing]\nrefresh_ms = 100\n')
    gw = Gateway(proc.url, config=config, log_dir=tmp_path)
    try:
        async with gateways(gw):
            answers = [
                await send(gw.url, chat(MODEL, f"question {i} " * 30, stream=i % 2 == 0)) for i in range(8)
            ]
            assert [a.status for a in answers] == [200] * 8, [(a.status, a.body[:200]) for a in answers]
            assert {a.headers["x-kvgate-worker"] for a in answers} == {"b"}
            assert "broke the connection before its first byte; routed to b" in gw.output()
            await poll(lambda: _settled(client), 10, "every lease and seat back")
            assert "Traceback" not in gw.output()
    finally:
        await client.aclose()
        await broken.cleanup()
        await good.cleanup()
        proc.stop()


async def _settled(client: aioredis.Redis) -> bool:
    leases = await client.zcard(keys.model_key(MODEL, "leases"))
    used = await client.hgetall(keys.model_key(MODEL, "used"))
    return leases == 0 and not used
