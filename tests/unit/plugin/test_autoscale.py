"""plugin/autoscale.py: the queue gauges and the expected wait from a real admission state in Redis,
and the log line of a run-time quota change."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from plugin.autoscale import QueueSignalRefresher, quota_change
from plugin.metrics import GatewayMetrics
from policy.admission import Quota
from policy.types import Band
from store.slots import SlotPool, Ticket, set_quota
from tests.prom import metric

MODEL = "llama"


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        pytest.param(None, {"total": "8"}, None, id="first read is a baseline"),
        pytest.param({"total": "8"}, {"total": "8"}, None, id="unchanged"),
        pytest.param({"total": "8"}, {"total": "16"}, "total 8 -> 16", id="changed"),
        pytest.param(
            {"total": "8", "tenant": "2"},
            {"total": "8", "aging_ms": "0"},
            "aging_ms - -> 0, tenant 2 -> -",
            id="added and removed",
        ),
    ],
)
def test_quota_change(old: dict[str, str] | None, new: dict[str, str], expected: str | None) -> None:
    assert quota_change(old, new) == expected


async def test_gauges_follow_the_global_queue_and_quota_changes_are_logged(
    redis: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = GatewayMetrics()
    await set_quota(redis, MODEL, Quota(total=1))
    async with SlotPool(redis, gateway_id="gw") as pool:
        refresher = QueueSignalRefresher(pool, metrics, lambda: [MODEL])
        idle = await refresher.refresh_once()
        assert idle[MODEL].expected_wait_s == 0.0 and sum(idle[MODEL].queued.values()) == 0

        held = await pool.acquire(Ticket("run", MODEL, Band.HIGH, "t"))
        waiters = [
            asyncio.ensure_future(pool.acquire(Ticket(f"q{i}", MODEL, band, "t", max_wait_s=30)))
            for i, band in enumerate((Band.HIGH, Band.LOW, Band.LOW))
        ]
        for _ in range(200):  # poll until all three are queued in Redis
            signal = (await refresher.refresh_once())[MODEL]
            if sum(signal.queued.values()) == 3:
                break
            await asyncio.sleep(0.01)
        assert signal.queued == {"low": 2, "normal": 0, "high": 1}
        assert signal.expected_wait_s > 0
        text = metrics.render()
        assert metric(text, "kvgate_global_queue_length", model="llama", band="low") == 2
        assert metric(text, "kvgate_expected_queue_wait_seconds", model="llama") is not None

        with caplog.at_level(logging.INFO, logger="plugin.autoscale"):
            await redis.hset(f"kvg:{{{MODEL}}}:quota", "total", "4")  # an operator's run-time change
            await refresher.refresh_once()
        assert "quota of llama changed at run time: total 1 -> 4" in caplog.text
        for lease in [held, *await asyncio.gather(*waiters)]:
            await pool.release(lease)
        assert sum((await refresher.refresh_once())[MODEL].queued.values()) == 0


async def test_background_refresh_sets_the_gauge_without_a_scrape(redis: aioredis.Redis) -> None:
    metrics = GatewayMetrics()
    async with SlotPool(redis, gateway_id="gw") as pool:
        refresher = QueueSignalRefresher(pool, metrics, lambda: [MODEL], period_s=0.02)
        await refresher.start()
        try:
            for _ in range(200):
                if metrics.expected_wait.values:
                    break
                await asyncio.sleep(0.01)
            assert metrics.expected_wait.values == {(MODEL,): 0.0}
        finally:
            await refresher.close()
