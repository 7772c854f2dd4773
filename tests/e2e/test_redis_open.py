"""`gateway.redis_failure = "open"` with real processes: two `kvgate proxy` gateways on one redis-server
that is killed with SIGKILL under held streams, then started again empty on the same port.

While Redis is gone each gateway admits up to its local share (total 4 / 2 gateways = 2 seats, the
stream it held before the outage included) and answers 503 past it; once Redis is back every
running stream is counted in it exactly once, and every seat comes back when they end.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from plugin.open_admission import GATEWAYS_KEY
from runtime.tasks import spawn
from store import keys
from tests.e2e.faults import Answer, RedisProcess, send
from tests.e2e.harness import Gateway, SseUpstream, chat, gateways, poll

pytestmark = pytest.mark.e2e

MODEL = "m"
CONFIG = f"""
[gateway]
redis_failure = "open"

[models."{MODEL}"]
total = 4
[routing]
refresh_ms = 100
[admission]
lease_ms = 4000
renew_every_ms = 500
"""


async def _used(url: str) -> tuple[int, int]:
    """(used.total, live leases) of the model in Redis."""
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        used = int(await client.hget(keys.model_key(MODEL, "used"), "total") or 0)
        return used, int(await client.zcard(keys.model_key(MODEL, "leases")))
    finally:
        await client.aclose()


async def test_open_mode_admits_a_local_share_and_reconciles_on_recovery(
    upstream: SseUpstream, tmp_path: Path
) -> None:
    redis_proc = RedisProcess().start()
    try:
        await _scenario(redis_proc, upstream, tmp_path)
    finally:
        redis_proc.stop()


async def _scenario(redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text(CONFIG)
    a, b = (
        Gateway(redis_proc.url, config=config, workers=[upstream.url], model=MODEL, log_dir=tmp_path,
                gateway_id=name)
        for name in ("a", "b")
    )  # fmt: skip
    upstream.release = asyncio.Event()
    async with gateways(a, b):
        client = aioredis.Redis.from_url(redis_proc.url)
        await poll(lambda: _count(client, 2), 10, "both gateways in kvg:gateways:open")
        await client.aclose()
        before = spawn(send(a.url, chat(MODEL, "before", stream=True)), name="before")
        await poll(lambda: _reached(upstream, 1), 10, "the stream held before the outage")
        await asyncio.sleep(0.3)  # both gateways' beats read total 4 and 2 gateways

        redis_proc.kill()
        burst = [
            spawn(send(gw.url, chat(MODEL, f"down {gw.gateway_id} {i}", stream=True)), name=f"d{i}")
            for gw in (a, b) for i in range(4)
        ]  # fmt: skip
        await poll(lambda: _reached(upstream, 4), 15, "the local shares at the upstream")
        await asyncio.sleep(0.5)  # a gate that lets more through would have by now
        assert len(upstream.first_sent_at) == 4  # a: 1 held + 1 local; b: 2 local; = the quota
        refused: list[Answer] = [t.result() for t in burst if t.done()]
        assert len(refused) == 5, [(r.status, r.body[:200]) for r in refused]
        assert {r.status for r in refused} == {503}
        assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
        assert {json.loads(r.body)["error"]["code"] for r in refused} == {"redis_unavailable"}

        redis_proc.start()  # empty, on the same port
        await poll(lambda: _counted(redis_proc.url, 4), 15, "the 4 running streams counted in Redis")
        await asyncio.sleep(1.2)  # more renewals: nothing is counted twice
        assert await _used(redis_proc.url) == (4, 4)

        upstream.release.set()
        answers = [await before, *[await t for t in burst]]
        assert sorted(x.status for x in answers) == [200] * 4 + [503] * 5
        await poll(lambda: _counted(redis_proc.url, 0), 10, "every seat back")
        for gw in (a, b):
            assert "Traceback" not in gw.output()
            assert "admitting locally (redis_failure = open)" in gw.output()


async def _count(client: aioredis.Redis, n: int) -> bool:
    return int(await client.zcard(GATEWAYS_KEY)) == n


async def _reached(upstream: SseUpstream, n: int) -> bool:
    return len(upstream.first_sent_at) >= n


async def _counted(url: str, n: int) -> bool:
    try:
        return await _used(url) == (n, n)
    except OSError:
        return False


async def test_open_mode_worst_case_stays_within_its_bound(upstream: SseUpstream, tmp_path: Path) -> None:
    """The worst case of docs/REDIS.md: one gateway held the whole quota when Redis went away, the
    other adds its share on top. Running, at the upstream's own count, reaches the bound
    total × (2 − 1/gateways) = 4 × 1.5 = 6 and never passes it."""
    redis_proc = RedisProcess().start()
    config = tmp_path / "kvgate.toml"
    config.write_text(CONFIG)
    a, b = (
        Gateway(redis_proc.url, config=config, workers=[upstream.url], model=MODEL, log_dir=tmp_path,
                gateway_id=name)
        for name in ("a", "b")
    )  # fmt: skip
    upstream.release = asyncio.Event()
    bound = 4 * 2 - 4 // 2  # total + (gateways - 1) × floor(total / gateways)
    try:
        async with gateways(a, b):
            client = aioredis.Redis.from_url(redis_proc.url)
            await poll(lambda: _count(client, 2), 10, "both gateways in kvg:gateways:open")
            await client.aclose()
            held = [spawn(send(a.url, chat(MODEL, f"held {i}", stream=True)), name=f"h{i}") for i in range(4)]
            await poll(lambda: _reached(upstream, 4), 10, "gateway a holding the whole quota")
            await asyncio.sleep(0.3)
            redis_proc.kill()
            burst = [
                spawn(send(gw.url, chat(MODEL, f"down {gw.gateway_id} {i}", stream=True)), name=f"d{i}")
                for gw in (a, b) for i in range(4)
            ]  # fmt: skip
            await poll(lambda: _reached(upstream, bound), 15, "gateway b's share at the upstream")
            await asyncio.sleep(1.0)  # a gate that lets more through would have by now
            assert len(upstream.first_sent_at) == bound  # a: 0 more (holds 4 > its share 2); b: 2
            refused = [t.result() for t in burst if t.done()]
            assert len(refused) == 6 and {r.status for r in refused} == {503}

            redis_proc.start()  # empty: the reclaims fit the quota, the rest run uncounted
            await poll(lambda: _counted(redis_proc.url, 4), 15, "the quota's worth counted again")
            late = spawn(send(b.url, chat(MODEL, "after recovery", stream=True)), name="late")
            await asyncio.sleep(1.5)  # the quota is full in Redis: the newcomer waits
            assert len(upstream.first_sent_at) == bound and not late.done()
            upstream.release.set()
            answers = [await t for t in (*held, *burst, late)]
            assert sorted(x.status for x in answers) == [200] * (bound + 1) + [503] * 6
            await poll(lambda: _counted(redis_proc.url, 0), 10, "every seat back")
            for gw in (a, b):
                assert "Traceback" not in gw.output()
    finally:
        redis_proc.stop()
