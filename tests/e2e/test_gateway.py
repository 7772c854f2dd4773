"""End to end through a real gateway: `kvgate proxy` subprocesses (mitmdump + kvgate addon) on loopback.

Needs: the embedded redis-server (tests/conftest.py), a free loopback port per process, and the
.venv's mitmproxy. Upstreams run in the test's loop: a controllable SSE server (harness.SseUpstream)
for streaming and queueing, emulated vLLM workers (bench/emulator) for routing and quotas; the
gateways register them as static workers (`--worker URL --model M`). Every process is stopped in
teardown (harness.gateways).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.e2e.harness import Gateway, SseUpstream, chat, gateways, get, metric, poll, post, start_worker

pytestmark = [pytest.mark.e2e, pytest.mark.redis_cluster]  # each test on standalone Redis and on a cluster

MODEL = "m"


def write_config(tmp_path: Path, total: int, extra: str = "") -> Path:
    path = tmp_path / "kvgate.toml"
    path.write_text(f'[models."{MODEL}"]\ntotal = {total}\n\n[routing]\nrefresh_ms = 100\n{extra}')
    return path


async def open_stream(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None,
                      text: str = "hi") -> aiohttp.ClientResponse:  # fmt: skip
    return await session.post(
        f"{url}/v1/chat/completions", json=chat(MODEL, text, stream=True), headers=headers
    )


async def inflight(gw: Gateway) -> float:
    _, body = await get(f"{gw.metrics_url}/metrics")
    return metric(body.decode(), "kvgate_inflight_requests", model=MODEL) or 0.0


async def test_tokens_stream_through_unbuffered(redis: aioredis.Redis, redis_url: str, tmp_path: Path,
                                                upstream: SseUpstream) -> None:  # fmt: skip
    gw = Gateway(redis_url, write_config(tmp_path, 4), workers=[upstream.url], model=MODEL, log_dir=tmp_path)
    async with gateways(gw), aiohttp.ClientSession() as session:
        upstream.release.set()  # warm-up request, both paths (connections, imports)
        for url in (upstream.url, gw.url):
            async with await open_stream(session, url) as resp:
                await resp.read()
        upstream.release.clear()
        first_s = {}
        for name, url in (("direct", upstream.url), ("gateway", gw.url)):
            started = time.monotonic()
            async with await open_stream(session, url) as resp:
                assert resp.status == 200
                line = await resp.content.readline()
                first_s[name] = time.monotonic() - started
                assert line.startswith(b"data: ")
                assert len(upstream.finished_at) == len(upstream.first_sent_at) - 1  # upstream still held
                upstream.release.set()
                rest = await resp.read()
                upstream.release.clear()
            assert rest.rstrip().endswith(b"data: [DONE]")
            assert b'"usage"' not in rest  # the usage chunk kvgate asked for is not shown to the client
        direct_ms, gateway_ms = first_s["direct"] * 1e3, first_s["gateway"] * 1e3
        print(f"first chunk: direct {direct_ms:.1f} ms, through kvgate {gateway_ms:.1f} ms")
        assert upstream.seen[-1]["body"]["stream_options"] == {"include_usage": True}
        assert upstream.seen[-1]["headers"]["Host"].startswith("127.0.0.1:")


BAD_REQUESTS = [
    pytest.param(b"{not json", 400, "invalid_json", id="malformed"),
    pytest.param(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 7}]}).encode(), 400,
                 "invalid_content", id="wrong type"),
    pytest.param(json.dumps({"model": MODEL, "messages": []}).encode(), 400, "missing_messages", id="empty"),
    pytest.param(json.dumps({**chat(MODEL, "x"), "max_tokens": "9"}).encode(), 400, "invalid_type", id="str"),
    pytest.param(json.dumps(chat(MODEL, "x" * 3000)).encode(), 413, "request_too_large", id="oversized"),
    # over mitmproxy's body_size_limit (2 x max_body_bytes): mitmproxy's own 413, made JSON
    pytest.param(json.dumps(chat(MODEL, "x" * 5000)).encode(), 413, "request_too_large", id="way oversized"),
    pytest.param(json.dumps(chat("nope", "x")).encode(), 404, "model_not_found", id="unknown model"),
]  # fmt: skip


async def test_bad_requests_get_json_errors_and_disturb_nothing(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path, upstream: SseUpstream
) -> None:
    config = write_config(tmp_path, 1, "\n[limits]\nmax_body_bytes = 2000\n")
    gw = Gateway(redis_url, config, workers=[upstream.url], model=MODEL, log_dir=tmp_path)
    async with gateways(gw):
        for case in BAD_REQUESTS:
            body, status, code = case.values
            got, headers, content = await post(f"{gw.url}/v1/chat/completions", body)  # type: ignore[arg-type]
            assert (got, headers["Content-Type"]) == (status, "application/json"), case.id
            assert json.loads(content)["error"]["code"] == code, case.id
        got, _, content = await post(f"{gw.url}/v1/embeddings", chat(MODEL, "x"))
        assert got == 404 and json.loads(content)["error"]["code"] == "not_found"
        assert upstream.seen == []  # nothing reached a worker (nor mitmproxy's fallback upstream)
        upstream.release.set()
        ok, _, _ = await post(f"{gw.url}/v1/chat/completions", chat(MODEL, "fine", stream=True),
                              headers={"x-kvgate-max-wait-ms": "0"})  # fmt: skip
        assert ok == 200  # the single slot was not leaked by the bad requests


async def test_client_leaving_mid_stream_frees_its_slot(redis_url: str, redis: aioredis.Redis, tmp_path: Path,
                                                       upstream: SseUpstream) -> None:  # fmt: skip
    gw = Gateway(redis_url, write_config(tmp_path, 1), workers=[upstream.url], model=MODEL, log_dir=tmp_path)
    async with gateways(gw):
        async with aiohttp.ClientSession() as session:
            resp = await open_stream(session, gw.url)
            await resp.content.readline()
            # the metrics port's gauges are refreshed every second
            await poll(lambda: _inflight_is(gw, 1), 5, "the stream in flight")
            resp.close()  # drop the connection mid-stream
        await poll(lambda: _zero(gw), 10, "the slot to be released")
        upstream.release.set()
        status, _, _ = await post(f"{gw.url}/v1/chat/completions", chat(MODEL, "next", stream=True),
                                  headers={"x-kvgate-max-wait-ms": "2000"})  # fmt: skip
        assert status == 200


async def _zero(gw: Gateway) -> bool:
    return await inflight(gw) == 0


async def _inflight_is(gw: Gateway, n: int) -> bool:
    return await inflight(gw) == n


async def test_queue_order_priority_and_disconnect_while_queued(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path, upstream: SseUpstream
) -> None:
    gw = Gateway(redis_url, write_config(tmp_path, 1), workers=[upstream.url], model=MODEL, log_dir=tmp_path)
    async with gateways(gw), aiohttp.ClientSession() as session:
        holder = await open_stream(session, gw.url, text="holder")
        await holder.content.readline()

        async def queued(text: str, priority: str) -> int:
            async with await open_stream(session, gw.url, {"x-kvgate-priority": priority}, text) as resp:
                await resp.read()
                return resp.status

        async def queue_length(n: int) -> bool:
            _, body = await get(f"{gw.metrics_url}/metrics")
            return metric(body.decode(), "kvgate_queue_length", model=MODEL) == n

        low = asyncio.ensure_future(queued("low", "low"))
        await poll(lambda: queue_length(1), 10, "low to queue")
        gone_session = aiohttp.ClientSession()
        gone = asyncio.ensure_future(open_stream(gone_session, gw.url, {"x-kvgate-priority": "high"}, "gone"))
        await poll(lambda: queue_length(2), 10, "the leaver to queue")
        high = asyncio.ensure_future(queued("high", "high"))
        await poll(lambda: queue_length(3), 10, "high to queue")
        gone.cancel()
        await gone_session.close()  # the high-priority waiter leaves before any slot frees
        await poll(lambda: queue_length(2), 10, "the leaver to leave the queue")
        upstream.release.set()
        await holder.read()
        holder.close()
        assert await asyncio.wait_for(asyncio.gather(low, high), 30) == [200, 200]
        started = [s["body"]["messages"][-1]["content"] for s in upstream.seen]
        assert started == ["holder", "high", "low"]  # priority order; the leaver never started


async def test_same_prefix_sticks_then_moves_off_a_saturated_worker(redis_url: str, redis: aioredis.Redis,
                                                                     tmp_path: Path) -> None:  # fmt: skip
    runners, urls = [], []
    for i in range(2):
        runner, url = await start_worker(MODEL, f"w{i}", time_scale=0.05)
        runners.append(runner)
        urls.append(url)
    try:
        config = write_config(tmp_path, 64)
        gw = Gateway(redis_url, config, workers=urls, model=MODEL, worker_max_concurrency=2, log_dir=tmp_path)
        system = "You are the support assistant of ACME. " * 60
        async with gateways(gw):
            served = []
            for i in range(4):  # one at a time: the worker always has room
                body = chat(MODEL, f"question {i}", system=system, max_tokens=4)
                status, headers, _ = await post(f"{gw.url}/v1/chat/completions", body)
                assert status == 200
                served.append(headers["x-kvgate-worker"])
            assert len(set(served)) == 1, served
            # now flood the same prefix: more at once than one worker runs, so some must move off
            bodies = [chat(MODEL, f"burst {i}", system=system, max_tokens=200) for i in range(8)]
            results = await asyncio.gather(*(post(f"{gw.url}/v1/chat/completions", b) for b in bodies))
            assert all(r[0] == 200 for r in results)
            assert len({r[1]["x-kvgate-worker"] for r in results}) == 2
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_quota_holds_across_two_gateways(redis_url: str, redis: aioredis.Redis, tmp_path: Path) -> None:
    runner, url = await start_worker(MODEL, "solo", time_scale=0.05)
    try:
        config = write_config(tmp_path, 2)
        gws = [Gateway(redis_url, config, workers=[url], model=MODEL, gateway_id=f"g{i}", log_dir=tmp_path)
               for i in range(2)]  # fmt: skip
        async with gateways(*gws):
            bodies = [chat(MODEL, f"req {i}", max_tokens=60, stream=True) for i in range(12)]
            results = await asyncio.gather(
                *(post(f"{gws[i % 2].url}/v1/chat/completions", b) for i, b in enumerate(bodies))
            )
            assert [r[0] for r in results] == [200] * 12
            _, body = await get(f"{url}/metrics")
            peak = metric(body.decode(), "kvgate_emulator_max_concurrent_requests")
            assert peak is not None and 1 <= peak <= 2
    finally:
        await runner.cleanup()


async def test_unreachable_worker_gives_json_502_and_frees_the_slot(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    upstream = await SseUpstream(MODEL).start()
    gw = Gateway(redis_url, write_config(tmp_path, 1), workers=[upstream.url], model=MODEL, log_dir=tmp_path)
    async with gateways(gw):
        await upstream.close()  # the worker dies; its lease has a few seconds left
        for _ in range(2):  # the second one would get 429 if the first had kept the only slot
            status, headers, body = await post(f"{gw.url}/v1/chat/completions", chat(MODEL, "x"),
                                               headers={"x-kvgate-max-wait-ms": "0"})  # fmt: skip
            assert (status, headers["Content-Type"]) == (502, "application/json")
            assert json.loads(body)["error"]["code"] == "upstream_error"
        await asyncio.sleep(1.2)  # one refresh of the metrics port's gauges
        assert await inflight(gw) == 0
