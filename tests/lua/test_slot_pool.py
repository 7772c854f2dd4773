"""store.slots.SlotPool against a real Redis, with two pools standing in for two gateway processes.

Each pool has its own Redis client and pub/sub subscription, as separate gateways would. Nothing here
asserts on wall-clock speed; the wake-up latency test prints its p50/p99 for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from policy.admission import Quota
from policy.types import Band
from store import keys
from store.connect import redis_from_url
from store.scripts import register_scripts
from store.slots import (
    AdmissionRejected,
    LeaseLost,
    QueueFull,
    SlotPool,
    Ticket,
    WaitBudgetExceeded,
    WorkerFull,
    get_quota,
    live_leases,
    set_quota,
)
from tests.polling import until

pytestmark = pytest.mark.redis_cluster  # each test on standalone Redis and on a cluster

M = "llama"


@pytest.fixture
async def pools(redis: aioredis.Redis, redis_url: str) -> AsyncIterator[tuple[SlotPool, SlotPool]]:
    await set_quota(redis, M, Quota())  # explicitly unlimited unless a test sets one (missing = refused)
    clients = [redis_from_url(redis_url) for _ in range(2)]
    made = [
        SlotPool(c, gateway_id=f"gw{i}", lease_ms=2000, renew_every_ms=200) for i, c in enumerate(clients)
    ]
    for pool in made:
        await pool.start()
    try:
        yield made[0], made[1]
    finally:
        for pool in made:
            await pool.close()
        for c in clients:
            await c.aclose()


def ticket(
    rid: str, band: Band = Band.NORMAL, tenant: str = "t", wait_s: float = 10.0, seats: int = 1
) -> Ticket:
    return Ticket(rid, M, band, tenant, seats=seats, max_wait_s=wait_s)


async def queued(pool: SlotPool) -> int:
    return sum((await pool.snapshot(M))["queued"].values())


async def test_set_quota_round_trips(redis: aioredis.Redis) -> None:
    q = Quota(total=3, band={Band.HIGH: 2}, tenant=1)
    await set_quota(redis, M, q)
    assert await get_quota(redis, M) == q


async def test_release_in_one_gateway_wakes_a_waiter_in_the_other(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    a, b = pools
    await set_quota(redis, M, Quota(total=1))
    latencies = []
    for i in range(100):
        lease = await a.acquire(ticket(f"hold{i}"))
        waiter = asyncio.ensure_future(b.acquire(ticket(f"wait{i}")))
        await until(lambda: _queued_one(a))
        t0 = time.perf_counter()
        await a.release(lease)
        woken = await waiter
        latencies.append(time.perf_counter() - t0)
        assert woken.request_id == f"wait{i}" and woken.queued_s > 0
        await b.release(woken)
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    p50 = statistics.median(latencies)
    print(f"\nwake-up after release (round trip included): p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms")
    assert a.held() == b.held() == 0


async def _queued_one(pool: SlotPool) -> bool:
    return await queued(pool) == 1


async def test_two_gateways_never_exceed_the_quota(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    await set_quota(redis, M, Quota(total=4, tenant=3, band={Band.LOW: 1}))
    running: dict[str, int] = {"total": 0, "max": 0}
    per_tenant: dict[str, int] = {}
    low = {"now": 0, "max": 0}
    rng = random.Random(7)

    async def one(i: int) -> None:
        pool = pools[i % 2]
        band = rng.choice(list(Band))
        tenant = rng.choice(["acme", "bolt"])
        lease = await pool.acquire(ticket(f"r{i}", band, tenant, seats=rng.choice([1, 1, 2])))
        running["total"] += lease.seats
        running["max"] = max(running["max"], running["total"])
        per_tenant[tenant] = per_tenant.get(tenant, 0) + lease.seats
        assert per_tenant[tenant] <= 3
        low["now"] += lease.seats if band == Band.LOW else 0
        low["max"] = max(low["max"], low["now"])
        await asyncio.sleep(rng.random() * 0.01)
        running["total"] -= lease.seats
        per_tenant[tenant] -= lease.seats
        low["now"] -= lease.seats if band == Band.LOW else 0
        await pool.release(lease)

    await asyncio.gather(*(one(i) for i in range(120)))
    assert running["max"] <= 4 and low["max"] <= 1
    assert running["max"] >= 2  # the gate did let requests run side by side
    snap = await pools[0].snapshot(M)
    assert snap["leases"] == 0 and sum(snap["queued"].values()) == 0
    assert pools[0].held() == pools[1].held() == 0


async def test_full_queue_rejects_with_retry_after(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    a, _ = pools
    await set_quota(redis, M, Quota(total=1, queue_max=1))
    lease = await a.acquire(ticket("run"))
    waiter = asyncio.ensure_future(a.acquire(ticket("w")))
    await until(lambda: _queued_one(a))
    with pytest.raises(QueueFull) as info:
        await a.acquire(ticket("x"))
    assert info.value.status == 429 and info.value.reason == "queue_full" and info.value.retry_after_s >= 1
    with pytest.raises(AdmissionRejected) as no_wait:
        await a.acquire(ticket("y", wait_s=0))
    assert no_wait.value.reason == "quota"
    await a.release(lease)
    await a.release(await waiter)


async def test_wait_budget_runs_out(redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]) -> None:
    a, _ = pools
    await set_quota(redis, M, Quota(total=1))
    lease = await a.acquire(ticket("run"))
    with pytest.raises(WaitBudgetExceeded) as info:
        await a.acquire(ticket("w", wait_s=0.2))
    assert info.value.reason == "wait_budget"
    assert await queued(a) == 0
    await a.release(lease)


async def test_cancelled_waiter_leaves_the_queue_at_once(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    a, b = pools
    await set_quota(redis, M, Quota(total=1))
    lease = await a.acquire(ticket("run"))
    gone = asyncio.ensure_future(b.acquire(ticket("gone")))
    await until(lambda: _queued_one(a))
    after = asyncio.ensure_future(b.acquire(ticket("after")))
    await until(lambda: _queued_two(a))
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert await queued(a) == 1  # left the queue before cancellation returned
    await a.release(lease)
    assert (await after).request_id == "after"  # the slot went to the next waiter, not the cancelled one
    assert b.held() == 1


async def _queued_two(pool: SlotPool) -> bool:
    return await queued(pool) == 2


async def test_a_grant_that_races_cancellation_is_released(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    a, b = pools
    await set_quota(redis, M, Quota(total=1))
    lease = await a.acquire(ticket("run"))
    waiter = asyncio.ensure_future(b.acquire(ticket("raced")))
    await until(lambda: _queued_one(a))
    # Redis grants the seat to "raced", announced on a channel b does not hear, so b cannot resume first ...
    await register_scripts(redis, channel="kvg:test:unheard").release(M, "run")
    waiter.cancel()  # ... and its client goes away before b learns of the grant
    with pytest.raises(asyncio.CancelledError):
        await waiter
    snap = await a.snapshot(M)
    assert snap["leases"] == 0 and snap["used"]["total"] == 0
    assert b.held() == 0
    await a.release(lease)  # already gone in Redis: harmless


async def test_a_waiter_cancelled_at_any_point_of_its_acquire_leaves_no_lease(
    redis: aioredis.Redis, redis_url: str
) -> None:
    """The race above at every point of the acquire's round trip, one event-loop step apart: before
    the script is sent, while its reply is outstanding, once queued; each time from a new gateway
    (its own client), as a fresh connection is where it showed. On a cluster, a leave sent while the
    acquire's reply was outstanding once overtook the acquire (on another connection), and the
    acquire then leased the seat freed meanwhile to a request that had already gone."""
    await set_quota(redis, M, Quota(total=1))
    releaser = register_scripts(redis, channel="kvg:test:unheard")
    for steps in range(0, 60, 2):
        await redis.script_flush()
        client = redis_from_url(redis_url)
        try:
            async with SlotPool(client, gateway_id="gw", lease_ms=5000, renew_every_ms=1000) as b:
                await releaser.acquire(M, "run", Band.NORMAL, "t", 1, 5000, 0, "other-gw")
                waiter = asyncio.ensure_future(b.acquire(ticket("raced")))
                for _ in range(steps):
                    await asyncio.sleep(0)
                await releaser.release(M, "run")
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
                snap = await b.snapshot(M)
                assert (snap["leases"], b.held()) == (0, 0), f"cancelled after {steps} steps"
        finally:
            await client.aclose()


async def test_expired_lease_is_regranted_by_the_safety_recheck(
    redis: aioredis.Redis, redis_url: str
) -> None:
    await set_quota(redis, M, Quota(total=1))
    client = redis_from_url(redis_url)
    try:
        async with SlotPool(
            client, gateway_id="gw", lease_ms=300, renew_every_ms=100, recheck_every_s=0.05
        ) as pool:
            # a crashed gateway's lease: nobody renews or releases it
            await pool.scripts.acquire(M, "crashed", Band.NORMAL, "t", 1, 300, 0, "dead-gw")
            lease = await pool.acquire(ticket("w", wait_s=5))
            assert lease.queued_s > 0
            await pool.release(lease)
    finally:
        await client.aclose()


async def test_renewal_keeps_leases_alive_and_close_lets_them_expire(
    redis: aioredis.Redis, redis_url: str
) -> None:
    await set_quota(redis, M, Quota(total=1))
    client = redis_from_url(redis_url)
    try:
        # a renewal may be late by a 250 ms loop stall and the lease still holds (800 - 50 ms of margin)
        pool = SlotPool(client, gateway_id="gw", lease_ms=800, renew_every_ms=50)
        await pool.start()
        await pool.acquire(ticket("long"))
        start = time.monotonic()
        while time.monotonic() - start < 1.6:  # twice the lease: only renewal keeps it
            assert (await pool.snapshot(M))["leases"] == 1
            await asyncio.sleep(0.05)
        assert pool.leases_lost == 0 and pool.held() == 1
        await pool.close()
        await until(lambda: _no_leases(pool))
    finally:
        await client.aclose()


async def _no_leases(pool: SlotPool) -> bool:
    return (await pool.snapshot(M))["leases"] == 0


async def test_quota_change_applies_to_the_next_call(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    a, _ = pools
    await set_quota(redis, M, Quota(total=1))
    first = await a.acquire(ticket("a"))
    with pytest.raises(AdmissionRejected):
        await a.acquire(ticket("b", wait_s=0))
    await set_quota(redis, M, Quota(total=2))
    second = await a.acquire(ticket("b", wait_s=0))
    await a.release(first)
    await a.release(second)


def test_renew_period_must_be_shorter_than_the_lease(redis: aioredis.Redis) -> None:
    with pytest.raises(ValueError, match="renew_every_ms"):
        SlotPool(redis, gateway_id="gw", lease_ms=1000, renew_every_ms=1000)


async def test_two_step_admission_worker_full_and_place_after_wait(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    a, b = pools
    await set_quota(redis, M, Quota(total=1))
    await redis.hset(keys.worker(M, "w1"), "max_concurrency", 1)
    first = await a.acquire(ticket("a"), worker="w1")
    assert first.worker == "w1"
    with pytest.raises(WorkerFull) as info:
        await b.acquire(ticket("b"), worker="w1")
    assert info.value.reason == "worker_full"
    waiter = asyncio.ensure_future(b.acquire(ticket("c"), worker="w2"))  # global quota is full: waits
    await until(lambda: _queued_one(a))
    await a.release(first)
    granted = await waiter
    assert granted.worker is None  # waited: routed again after the grant, then placed
    placed = await b.place(granted, "w1")
    assert placed.worker == "w1"
    await b.release(placed)
    with pytest.raises(LeaseLost):
        await b.place(placed, "w1")


async def test_release_of_a_placed_lease_signals_room_on_its_model(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    a, _ = pools
    placed = await a.acquire(ticket("a"), worker="w1")
    unplaced = await a.acquire(ticket("b"))
    before = asyncio.ensure_future(a.room_freed(M, 0.2))
    await a.release(unplaced)  # frees no worker's place: no signal
    assert await before is False  # timed out
    waiting = asyncio.ensure_future(a.room_freed(M, 5))
    other_model = asyncio.ensure_future(a.room_freed("other", 0.2))
    await a.release(placed)
    assert await asyncio.wait_for(waiting, 5) is True
    assert await other_model is False  # nothing of that model was released


async def test_a_worker_no_longer_full_is_announced_to_other_gateways(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    a, b = pools
    await redis.hset(keys.worker(M, "w1"), "max_concurrency", 2)
    one, two = [await a.acquire(ticket(rid), worker="w1") for rid in ("a1", "a2")]  # w1 full
    signal = b.room_signal(M)
    await a.release(one)  # full -> one free place: announced
    assert await b.room_freed(M, 5, signal) is True
    quiet = b.room_signal(M)
    await a.release(two)  # w1 was not full: no message
    assert await b.room_freed(M, 0.3, quiet) is False
    await redis.hset(keys.worker(M, "w1"), "max_concurrency", 1)
    wake_ms = []  # for the report (pytest -s -k announced): from before A's release to B's signal
    for i in range(50):
        lease = await a.acquire(ticket(f"w{i}"), worker="w1")
        signal = b.room_signal(M)
        started = time.perf_counter()
        await a.release(lease)
        assert await b.room_freed(M, 5, signal) is True
        wake_ms.append((time.perf_counter() - started) * 1000)
    cuts = statistics.quantiles(wake_ms, n=100)
    p50 = statistics.median(wake_ms)
    print(f"worker-freed wake-up across gateways: p50 {p50:.2f} ms, p99 {cuts[98]:.2f} ms")


async def test_live_leases_lists_unexpired_leases_for_the_audit(
    redis: aioredis.Redis, pools: tuple[SlotPool, SlotPool]
) -> None:
    a, b = pools
    first = await a.acquire(ticket("a", Band.HIGH, "acme", seats=2), worker="w1")
    await b.scripts.acquire(M, "stale", Band.LOW, "t", 1, 1, 0, "dead-gw", now_ms=1)  # expired long ago
    table = await live_leases(redis, M)
    assert set(table) == {"a"}
    assert table["a"] | {"granted_ms": 0, "expiry_ms": 0} == {
        "seats": 2, "band": Band.HIGH, "tenant": "acme", "worker": "w1", "gateway": "gw0",
        "granted_ms": 0, "expiry_ms": 0,
    }  # fmt: skip
    await a.release(first)
    assert await live_leases(redis, M) == {}


async def test_a_lease_redis_lost_is_reclaimed_for_its_running_request(redis: aioredis.Redis) -> None:
    """A Redis restart loses every lease: the holder's next renewal takes the seats back (when free),
    so the running requests count against the quota again."""
    await set_quota(redis, M, Quota(total=1))
    async with SlotPool(redis, gateway_id="gw", lease_ms=2000, renew_every_ms=200) as pool:
        lease = await pool.acquire(ticket("running"))
        await redis.flushdb()  # what a restart without persistence leaves
        await set_quota(redis, M, Quota(total=1))
        await pool.renew_now()
        assert pool.held() == 1 and pool.leases_reclaimed == 1 and pool.leases_lost == 0
        with pytest.raises(AdmissionRejected):
            await pool.acquire(ticket("newcomer", wait_s=0))
        await pool.release(lease)
