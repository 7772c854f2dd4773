"""Hybrid index end to end: one exact-mode pool where one worker publishes KV events and one does not.

Two emulated workers; `w0`'s agent indexes its KV events (exact entries), `p1`'s agent only registers
it (no events). The gateway routes `w0`'s warmed prefix on the agent's entries, and indexes what it
routes to `p1` from routing history in Redis (token-block hashes), so that worker is not left out; the
routing metric's `index` label says which kind matched.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from store import index_store, registry
from store.redis_server import free_port
from tests.e2e.harness import Gateway, chat, gateways, get, metric, poll, post, start_worker
from tests.e2e.test_exact_mode import CONFIG, MODEL, SYSTEM, WAIT_S, prefix_keys, processes, warm

pytestmark = pytest.mark.e2e
__all__ = ["processes"]  # the fixture, used by name


async def test_a_mixed_pool_routes_on_exact_entries_and_on_routing_history(
    redis: aioredis.Redis,
    redis_url: str,
    processes: Callable[..., subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    runners, urls = [], {}
    try:
        for wid, events in (("w0", True), ("p1", False)):
            zmq = f"tcp://127.0.0.1:{free_port()}"
            runner, url = await start_worker(
                MODEL, wid, time_scale=0.02, kv_events_endpoint=zmq if events else None
            )
            runners.append(runner)
            urls[wid] = url
            extra = ["--kv-events", zmq] if events else []
            processes("agent", "--worker-url", url, "--model", MODEL, "--worker-id", wid,
                      "--redis", redis_url, "--heartbeat-ms", "100", *extra)  # fmt: skip

        async def registered() -> bool:
            sizes = {r.id: r.router_block_size for r in await registry.read_workers(redis, MODEL, 0)}
            return sizes == {"w0": 16, "p1": 0}

        await poll(registered, WAIT_S, "w0 with KV events and p1 without registered", interval_s=0.05)
        config = tmp_path / "kvgate.toml"
        config.write_text(CONFIG)
        gw = Gateway(redis_url, config, log_dir=tmp_path)
        async with gateways(gw):
            await warm(redis, urls["w0"], "w0", chat(MODEL, "warm-up", system=SYSTEM, max_tokens=2))
            status, headers, text = await post(
                f"{gw.url}/v1/chat/completions", chat(MODEL, "question", system=SYSTEM, max_tokens=2)
            )
            assert status == 200, text
            assert headers["x-kvgate-worker"] == "w0"  # on the agent's exact entries

            # new prefixes until one lands on p1: the gateway writes its blocks to Redis for p1
            landed = None
            for i in range(16):
                body = chat(MODEL, "fresh", system=f"Prefix number {i}. " * 40, max_tokens=2)
                status, headers, text = await post(f"{gw.url}/v1/chat/completions", body)
                assert status == 200, text
                if headers["x-kvgate-worker"] == "p1":
                    landed = body
                    break
            assert landed is not None, "no new prefix was routed to p1 in 16 tries"
            keys = prefix_keys(landed)

            async def written() -> bool:
                return keys <= set((await index_store.load_snapshot(redis, MODEL)).get("p1", ()))

            await poll(written, WAIT_S, "the gateway to index p1's routed prefix in Redis", interval_s=0.05)
            again = chat(MODEL, "follow-up", system=landed["messages"][0]["content"], max_tokens=2)
            status, headers, text = await post(f"{gw.url}/v1/chat/completions", again)
            assert status == 200, text
            assert headers["x-kvgate-worker"] == "p1"  # on routing history: the pool did not fall back

            _, body = await get(f"{gw.metrics_url}/metrics")
            text = body.decode()
            reasons = "kvgate_routing_reasons_total"
            assert (metric(text, reasons, model=MODEL, index="exact") or 0) >= 1
            assert (metric(text, reasons, model=MODEL, index="approximate") or 0) >= 1
    finally:
        for runner in runners:
            await runner.cleanup()
