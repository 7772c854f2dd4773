"""A lease lost between planning and placement (issue 10, "Why" 5: `LeaseLost` was a 500).

A request granted a seat of the quota while its worker was full holds that seat while it waits for
room on the worker (two-step admission, plugin/placement.py `_wait_for`). If its lease expires in
Redis meanwhile (made to expire here: its expiry moved into the past, so the next script reaps it as
an expired lease), the placement finds it gone when room frees up: the client gets a 503 `lease_lost`
with Retry-After, and every seat returns. A worker that leaves the registry while a request waits
for it is the other way placement loses its target: 503 `no_healthy_worker`, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from runtime.tasks import spawn
from store import keys, registry
from store.registry import WorkerRecord
from tests.e2e.faults import RedisProcess, send
from tests.e2e.harness import Gateway, SseUpstream, chat, gateways, poll

pytestmark = pytest.mark.e2e

MODEL = "m"
# renewals far apart, so the test decides when the lease is found missing: at placement
CONFIG = f"""
[models."{MODEL}"]
total = 2

[routing]
refresh_ms = 100

[admission]
lease_ms = 30000
renew_every_ms = 10000
max_wait_ms = 20000
"""


async def waiting_lease(client: aioredis.Redis) -> str | None:
    """The id of the lease that holds a seat but no worker (the request waiting for room)."""
    for rid, info in (await client.hgetall(keys.model_key(MODEL, "lease"))).items():
        if not json.loads(info).get("k"):
            return rid.decode() if isinstance(rid, bytes) else str(rid)
    return None


async def _seat_held_without_worker(client: aioredis.Redis) -> bool:
    return await waiting_lease(client) is not None


async def _seats_back(client: aioredis.Redis) -> bool:
    """No lease left and every used count 0."""
    used = await client.hgetall(keys.model_key(MODEL, "used"))
    return await client.zcard(keys.model_key(MODEL, "leases")) == 0 and not any(int(v) for v in used.values())


async def test_a_lease_lost_while_waiting_for_its_worker_is_a_503_and_no_seat_leaks(
    upstream: SseUpstream, tmp_path: Path
) -> None:
    redis_proc = RedisProcess().start()
    client = aioredis.Redis.from_url(redis_proc.url)
    config = tmp_path / "kvgate.toml"
    config.write_text(CONFIG)
    gw = Gateway(redis_proc.url, config=config, workers=[upstream.url], model=MODEL, worker_max_concurrency=1,
                 log_dir=tmp_path)  # fmt: skip
    try:
        async with gateways(gw):
            running = spawn(send(gw.url, chat(MODEL, "runs", stream=True)), name="running")
            await poll(lambda: _reached(upstream, 1), 10, "the first request at the worker")
            waiting = spawn(send(gw.url, chat(MODEL, "waits", stream=True)), name="waiting")
            await poll(
                lambda: _seat_held_without_worker(client),
                10,
                "the second request holding a seat, waiting for room",
            )
            rid = await waiting_lease(client)
            assert rid is not None
            await client.zadd(keys.model_key(MODEL, "leases"), {rid: int(time.time() * 1000) - 1})  # expired
            upstream.release.set()  # room on the worker: the waiting request is placed now
            first, second = await running, await asyncio.wait_for(waiting, 20)
            assert first.status == 200, first.body[:300]
            assert second.status == 503, (second.status, second.body[:300])
            assert json.loads(second.body)["error"]["code"] == "lease_lost"
            assert second.headers.get("Retry-After") == "1"
            assert len(upstream.first_sent_at) == 1  # the request whose lease was lost never ran

            await poll(lambda: _seats_back(client), 10, "every seat back (no lease, used counts 0)")
            assert "gateway_error" not in gw.output() and "Traceback" not in gw.output()
            after = await send(gw.url, chat(MODEL, "after"))
            assert after.status == 200, after.body[:300]  # the quota is whole again
    finally:
        await client.aclose()
        redis_proc.stop()


async def test_a_worker_deregistered_while_a_request_waits_for_it_is_a_503(
    upstream: SseUpstream, tmp_path: Path
) -> None:
    redis_proc = RedisProcess().start()
    client = aioredis.Redis.from_url(redis_proc.url)
    config = tmp_path / "kvgate.toml"
    config.write_text(CONFIG)
    # the test is the worker's agent: a lease that outlives the test, max_concurrency 1
    record = WorkerRecord(id="w1", model=MODEL, url=upstream.url, max_concurrency=1)
    await registry.register(client, record, 120_000, int(time.time() * 1000))
    gw = Gateway(redis_proc.url, config=config, log_dir=tmp_path)
    try:
        async with gateways(gw):
            running = spawn(send(gw.url, chat(MODEL, "runs", stream=True)), name="running")
            await poll(lambda: _reached(upstream, 1), 10, "the first request at the worker")
            waiting = spawn(send(gw.url, chat(MODEL, "waits", stream=True)), name="waiting")
            await poll(
                lambda: _seat_held_without_worker(client),
                10,
                "the second request holding a seat, waiting for room",
            )
            # leaving as an agent does: drain (seen by the mirror within refresh_ms), then deregister
            await registry.set_draining(client, MODEL, "w1", True)
            await asyncio.sleep(0.5)
            await registry.deregister(client, MODEL, "w1")
            second = await asyncio.wait_for(waiting, 20)
            assert second.status == 503, (second.status, second.body[:300])
            assert json.loads(second.body)["error"]["code"] == "no_healthy_worker"
            assert second.headers.get("Retry-After") == "1"
            upstream.release.set()
            assert (await running).status == 200  # the running one finishes on its worker

            await poll(lambda: _seats_back(client), 10, "every seat back (no lease, used counts 0)")
            assert "gateway_error" not in gw.output() and "Traceback" not in gw.output()
    finally:
        await client.aclose()
        redis_proc.stop()


async def _reached(upstream: SseUpstream, n: int) -> bool:
    return len(upstream.first_sent_at) >= n
