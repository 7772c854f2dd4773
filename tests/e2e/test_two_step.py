"""Two-step admission end to end: a worker at its max_concurrency gets no more requests while the
global quota still has room; the overflow is rerouted or waits for the worker (per model config).

Needs: the embedded redis-server (tests/conftest.py), free loopback ports, the .venv's mitmproxy. The
gateway (`kvgate proxy`) registers the upstreams as static workers with `--worker-max-concurrency`;
upstreams run in the test's loop: emulated vLLM workers (their own peak concurrency is the check) and
controllable SSE servers (harness.SseUpstream: which requests each one started). Every process is
stopped in teardown (harness.gateways).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from plugin.decision_log import read_recent
from plugin.static_workers import static_worker_id
from tests.e2e.harness import Gateway, SseUpstream, chat, gateways, get, metric, poll, post, start_worker

pytestmark = [pytest.mark.e2e, pytest.mark.redis_cluster]  # each test on standalone Redis and on a cluster

MODEL = "m"


def write_config(tmp_path: Path, mode: str, policy: str) -> Path:
    path = tmp_path / "kvgate.toml"
    path.write_text(
        f'[models."{MODEL}"]\ntotal = 64\non_worker_full = "{mode}"\n\n'
        f'[routing]\nrefresh_ms = 100\npolicy = "{policy}"\n'
    )
    return path


async def worker_full(gw: Gateway, worker: str) -> float:
    _, body = await get(f"{gw.metrics_url}/metrics")
    return metric(body.decode(), "kvgate_worker_full_total", model=MODEL, worker=worker) or 0.0


async def record_of(redis: aioredis.Redis, request_id: str) -> dict[str, object]:
    async def written() -> bool:
        return any(r["request_id"] == request_id for r in await read_recent(redis, 50))

    await poll(written, 10, f"the decision record of {request_id}")
    return next(r for r in await read_recent(redis, 50) if r["request_id"] == request_id)


@pytest.mark.parametrize("mode", ["reroute", "wait"])
async def test_full_workers_get_no_more_requests_while_the_quota_has_room(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path, mode: str
) -> None:
    runners, urls = [], []
    for i in range(2):
        runner, url = await start_worker(MODEL, f"w{i}", time_scale=0.05)
        runners.append(runner)
        urls.append(url)
    try:
        gw = Gateway(redis_url, write_config(tmp_path, mode, "kvgate"), workers=urls, model=MODEL,
                     worker_max_concurrency=2, log_dir=tmp_path)  # fmt: skip
        async with gateways(gw):
            bodies = [chat(MODEL, f"question {i}", max_tokens=120, stream=True) for i in range(10)]
            results = await asyncio.gather(*(post(f"{gw.url}/v1/chat/completions", b) for b in bodies))
            assert [r[0] for r in results] == [200] * 10  # the quota (64) never held them
            for url in urls:  # the workers' own count of requests held at once
                _, body = await get(f"{url}/metrics")
                peak = metric(body.decode(), "kvgate_emulator_max_concurrent_requests")
                assert peak is not None and 1 <= peak <= 2, (url, peak)
            held = [r[1] for r in results if "x-kvgate-held-by" in r[1]]
            assert held and {h["x-kvgate-held-by"] for h in held} == {"worker"}
            total_full = sum([await worker_full(gw, static_worker_id(u)) for u in urls])
            assert total_full >= len(held)
            record = await record_of(redis, held[0]["x-kvgate-request-id"])
            assert record["held_by"] == "worker" and record["status"] == 200
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("mode", ["reroute", "wait"])
async def test_overflow_is_rerouted_or_waits_for_its_worker(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path, mode: str
) -> None:
    ups = [await SseUpstream(MODEL).start() for _ in range(2)]
    by_id = {static_worker_id(u.url): u for u in ups}
    gw = Gateway(redis_url, write_config(tmp_path, mode, "round_robin"), workers=[u.url for u in ups],
                 model=MODEL, worker_max_concurrency=1, log_dir=tmp_path)  # fmt: skip
    try:
        async with gateways(gw), aiohttp.ClientSession() as session:
            # round robin: the first request holds worker X, the second passes through Y, the third
            # is routed to X again, which is full while the quota (64) has room
            holder = await session.post(
                f"{gw.url}/v1/chat/completions", json=chat(MODEL, "holder", stream=True)
            )
            await holder.content.readline()
            x_id = holder.headers["x-kvgate-worker"]
            x = by_id[x_id]
            (y_id, y), *_ = [(i, u) for i, u in by_id.items() if i != x_id]
            y.release.set()
            status, headers, _ = await post(
                f"{gw.url}/v1/chat/completions", chat(MODEL, "passer", stream=True)
            )
            assert (status, headers["x-kvgate-worker"]) == (200, y_id)
            third = asyncio.ensure_future(
                post(f"{gw.url}/v1/chat/completions", chat(MODEL, "third", stream=True))
            )
            if mode == "wait":

                async def turned_down() -> bool:
                    return await worker_full(gw, x_id) == 1

                await poll(turned_down, 10, "X to turn the third request down")
                assert not third.done()
                assert (len(x.seen), len(y.seen)) == (1, 1)  # held: started nowhere, although Y is idle
                x.release.set()  # the holder finishes, X has room
                await holder.read()
            status, headers, _ = await asyncio.wait_for(third, 20)
            expect_worker, reroutes = (y_id, "1") if mode == "reroute" else (x_id, "0")
            assert status == 200 and headers["x-kvgate-worker"] == expect_worker
            assert (headers["x-kvgate-held-by"], headers["x-kvgate-reroutes"]) == ("worker", reroutes)
            assert [s["body"]["messages"][-1]["content"] for s in x.seen][:1] == ["holder"]
            assert len(x.seen) == (1 if mode == "reroute" else 2)
            record = await record_of(redis, headers["x-kvgate-request-id"])
            assert (record["held_by"], record["worker"], record["reroutes"]) == (
                "worker", expect_worker, int(reroutes)
            )  # fmt: skip
            x.release.set()
            holder.close()
    finally:
        for u in ups:
            await u.close()
