"""plugin/audit.py: the drift rule (table), persistence across audits, the lock, and expired-worker
cleanup against a real Redis with real leases from SlotPool and real agent registrations."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from plugin.audit import Auditor, Drift, compare, persistent
from plugin.metrics import GatewayMetrics
from policy.admission import Quota
from policy.types import Band
from store import index_store, registry
from store.registry import WorkerRecord
from store.slots import SlotPool, Ticket, set_quota
from tests.prom import metric

MODEL = "llama"


def worker(
    wid: str, *, ids: tuple[str, ...] = (), running: int | None = None, live: bool = True
) -> WorkerRecord:
    n = len(ids) if running is None else running
    return WorkerRecord(id=wid, model=MODEL, url=f"http://{wid}", running=n, inflight_ids=ids, live=live)


LEASES = {"a": {}, "b": {}}
CASES = [
    pytest.param([worker("w0", ids=("a",)), worker("w1", ids=("b",))], set(), set(), None, id="all matched"),
    pytest.param([worker("w0", ids=("a",))], {"b"}, set(), None, id="lease not running anywhere"),
    pytest.param([worker("w0", ids=("a", "b", "c"))], set(), {"c"}, None, id="running without a lease"),
    pytest.param(
        [worker("w0", ids=("a", "b")), worker("w1", ids=("z",), live=False)],
        set(),
        set(),
        None,
        id="expired worker ignored",
    ),
    pytest.param([worker("w0", running=3)], set(), set(), 1, id="worker without ids: count only"),
    pytest.param([worker("w0", ids=())], {"a", "b"}, set(), None, id="idle worker reporting nothing"),
]


@pytest.mark.parametrize(("workers", "held", "running", "count_only"), CASES)
def test_compare(
    workers: list[WorkerRecord], held: set[str], running: set[str], count_only: int | None
) -> None:
    drift = compare(MODEL, LEASES, workers)
    assert (set(drift.held_not_running), set(drift.running_not_held), drift.count_only) == (
        held, running, count_only
    )  # fmt: skip


def test_a_mismatch_counts_only_when_seen_in_two_consecutive_audits() -> None:
    first = Drift(MODEL, frozenset({"late-report", "stuck"}), frozenset({"just-released"}))
    second = Drift(MODEL, frozenset({"stuck"}), frozenset({"bypass"}))
    assert persistent(None, first).total == 0
    assert persistent(first, second) == Drift(MODEL, frozenset({"stuck"}), frozenset())
    counts = persistent(Drift(MODEL, frozenset(), frozenset(), 4), Drift(MODEL, frozenset(), frozenset(), 2))
    assert counts.total == 2


def now_ms() -> int:
    return int(time.time() * 1000)


async def register(redis: aioredis.Redis, wid: str, ids: tuple[str, ...], lease_ms: int = 60_000,
                   at_ms: int | None = None) -> None:  # fmt: skip
    rec = WorkerRecord(id=wid, model=MODEL, url=f"http://{wid}", max_concurrency=8, running=len(ids),
                       inflight_ids=ids)  # fmt: skip
    await registry.register(redis, rec, lease_ms=lease_ms, now_ms=at_ms or now_ms())


async def test_auditor_exports_persistent_drift_and_holds_the_lock(redis: aioredis.Redis) -> None:
    metrics = GatewayMetrics()
    await set_quota(redis, MODEL, Quota())
    async with SlotPool(redis, gateway_id="gw-a") as pool:
        for rid in ("r1", "r2", "r3"):
            await pool.acquire(Ticket(rid, MODEL, Band.NORMAL, "t"))
        # the worker runs r1, r2 and a request that bypassed the gateway; r3 holds a slot for nothing
        await register(redis, "w0", ("r1", "r2", "bypass"))
        auditor = Auditor(redis, metrics, gateway_id="gw-a", models=lambda: [MODEL], period_s=1.0)
        other = Auditor(redis, GatewayMetrics(), gateway_id="gw-b", models=lambda: [MODEL], period_s=1.0)
        first = await auditor.audit_once()
        assert first is not None and first[MODEL].total == 0  # one audit is not enough
        assert await other.audit_once() is None  # gw-a holds the lock
        second = await auditor.audit_once()
        assert second is not None
        assert second[MODEL] == Drift(MODEL, frozenset({"r3"}), frozenset({"bypass"}))
        assert metric(metrics.render(), "kvgate_slot_drift", model="llama") == 2
        await auditor.close()  # gives the lock up
        assert await other.audit_once() is not None


async def test_auditor_removes_an_expired_worker_and_its_index_entries(redis: aioredis.Redis) -> None:
    long_ago = now_ms() - 120_000
    await register(redis, "gone", (), lease_ms=1_000, at_ms=long_ago)
    await register(redis, "alive", ())
    await index_store.add_blocks(redis, MODEL, "gone", [11, 12, 13], now_ms=long_ago)
    auditor = Auditor(
        redis, GatewayMetrics(), gateway_id="gw-a", models=lambda: [MODEL], prune_grace_ms=30_000
    )
    await auditor.audit_once()
    assert [w.id for w in await registry.read_workers(redis, MODEL, now_ms())] == ["alive"]
    assert "gone" not in await index_store.load_snapshot(redis, MODEL)
