"""The metrics port (issue 12): its own listener answers scrapes and probes while the proxy is saturated
by many slow streams, and real requests through a real mitmdump fill the issue-12 metric families."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from bench.stack import Stack
from tests.e2e.harness import chat, get
from tests.prom import metric, total

pytestmark = pytest.mark.e2e

MODEL = "m"
STREAMS = 120


async def stream(session: aiohttp.ClientSession, url: str, i: int) -> int:
    body = chat(MODEL, f"shared system prompt for everyone {i % 4} " * 20, stream=True, max_tokens=200)
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        async for _ in resp.content.iter_any():
            pass
        return resp.status


async def timed_get(url: str) -> tuple[int, float, bytes]:
    started = time.monotonic()
    status, body = await get(url, timeout_s=20)
    return status, time.monotonic() - started, body


async def test_metrics_port_answers_under_a_saturated_proxy(tmp_path: Path) -> None:
    stack = Stack(log_dir=tmp_path / "logs")
    try:
        stack.start_redis()
        worker = stack.start_worker("w0", model=MODEL, profile="h100-llama3.1-8b", time_scale=1.0)
        config = tmp_path / "gateway.toml"
        config.write_text(f'[models."{MODEL}"]\ntotal = {STREAMS}\n\n[routing]\nrefresh_ms = 100\n')
        gateway = stack.start_gateway("g0", config=config, extra=["--worker", worker, "--model", MODEL])
        metrics_url = stack.metrics_urls[gateway]
        status, _ = await get(f"{metrics_url}/readyz")
        assert status == 200

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for i in range(4):  # each shared prefix once, so the load's requests find it in the index
                assert await stream(session, gateway, i) == 200
            await asyncio.sleep(0.5)  # the index write is batched
            load = asyncio.gather(*(stream(session, gateway, i) for i in range(STREAMS)))
            port_s, proxy_s = [], []
            await asyncio.sleep(0.5)  # the streams are open
            while not load.done():
                port, proxy = await asyncio.gather(
                    timed_get(f"{metrics_url}/metrics"), timed_get(f"{gateway}/readyz")
                )  # the proxy port's own probe, for comparison (it serves no /metrics)
                assert port[0] == 200 and proxy[0] == 200
                port_s.append(port[1])
                proxy_s.append(proxy[1])
                for probe in ("/healthz", "/readyz"):
                    assert (await get(f"{metrics_url}{probe}"))[0] == 200
                await asyncio.sleep(0.1)
            statuses = await load
        assert statuses == [200] * STREAMS
        print(f"scrape max: metrics port {max(port_s):.3f} s, proxy port /readyz {max(proxy_s):.3f} s "
              f"({len(port_s)} scrapes)")  # fmt: skip
        assert len(port_s) >= 3
        # the metrics port never waits for the proxy's loop: well inside Prometheus' 10 s scrape timeout
        assert max(port_s) < 2.0, (port_s, proxy_s)

        for path in ("/metrics", "/healthz"):  # only on the metrics port
            status, body = await get(f"{gateway}{path}")
            assert status == 404 and b"metrics port" in body, (path, status, body[:200])
        await asyncio.sleep(1.2)  # one refresh of the scrape-time gauges
        _, body = await get(f"{metrics_url}/metrics")
        text = body.decode()
        assert (
            metric(text, "kvgate_request_outcomes_total", model=MODEL, outcome="ok", arm="default")
            == STREAMS + 4
        )
        assert total(text, "kvgate_routing_reasons_total", model=MODEL, arm="default") == STREAMS + 4
        assert (
            total(text, "kvgate_routing_reasons_total", model=MODEL, reason="cache_hit", index="approximate")
            > 0
        )
        assert (
            metric(text, "kvgate_request_duration_seconds_count", model=MODEL, arm="default") == STREAMS + 4
        )
        assert metric(text, "kvgate_ttft_seconds_count", model=MODEL, arm="default") == STREAMS + 4
        reachable = metric(text, "kvgate_prefix_reachable_blocks_total", model=MODEL)
        achieved = metric(text, "kvgate_prefix_achieved_blocks_total", model=MODEL)
        assert reachable is not None and achieved is not None and 0 < achieved <= reachable
        assert (metric(text, "kvgate_estimated_cached_tokens_total", model=MODEL) or 0) > 0
        assert metric(text, "kvgate_worker_cached_tokens_total", model=MODEL) is not None
        assert metric(text, "kvgate_worker_inflight_requests", model=MODEL) == 0
        kv = metric(text, "kvgate_worker_kv_usage_ratio", model=MODEL)
        assert kv is not None and 0 <= kv <= 1
        age = metric(text, "kvgate_worker_lease_age_seconds", model=MODEL)
        assert age is not None and 0 <= age < 30
        assert (metric(text, "kvgate_redis_roundtrip_seconds_count") or 0) > 0
        assert metric(text, "kvgate_redis_errors_total") == 0
    finally:
        stack.close()
