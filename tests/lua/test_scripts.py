"""The admission Lua scripts on a real Redis: every return path, expiry, limits and queue order."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from policy.admission import AdmitCode, CheckStatus, ClaimCode, Quota, ReleaseCode
from policy.types import Band
from store import keys
from store.scripts import AdmissionScripts, model_keys, quota_key, register_scripts

pytestmark = pytest.mark.redis_cluster  # each test on standalone Redis and on a cluster

H, N, L = Band.HIGH, Band.NORMAL, Band.LOW
M = "llama"
T0 = 1_000_000


@pytest.fixture
async def scripts(redis: aioredis.Redis) -> AdmissionScripts:
    """The scripts, with model M explicitly unlimited (a missing quota hash is refused)."""
    await quota(redis, Quota())
    return register_scripts(redis)


async def quota(redis: aioredis.Redis, q: Quota, model: str = M) -> None:
    await redis.delete(quota_key(model))
    await redis.hset(quota_key(model), mapping=q.to_hash())


async def take(
    s: AdmissionScripts, rid: str, band: Band = N, tenant: str = "t", seats: int = 1, wait_ms: int = 60_000,
    now: int = T0, lease_ms: int = 10_000, model: str = M,
) -> AdmitCode:  # fmt: skip
    return (await s.acquire(model, rid, band, tenant, seats, lease_ms, wait_ms, "gw", now_ms=now)).code


# ---- every return path --------------------------------------------------------------------------


async def test_a_missing_quota_refuses_and_grants_nothing(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    """A Redis restart loses the quota hash: never unlimited. Nothing is admitted, queued or granted
    until the hash is back; releases still work."""
    await quota(redis, Quota(total=1))
    assert await take(scripts, "a") == AdmitCode.ADMITTED
    assert await take(scripts, "b") == AdmitCode.QUEUED
    await redis.delete(quota_key(M))
    refused = await scripts.acquire(M, "c", N, "t", 1, 10_000, 5000, "gw", now_ms=T0)
    assert (refused.code, refused.seats) == (AdmitCode.QUOTA_MISSING, 0)
    released = await scripts.release(M, "a", now_ms=T0)
    assert released.granted == ()  # b is not granted a seat of an unknown quota
    snap = await scripts.snapshot(M, now_ms=T0)
    assert (snap["used"]["total"], snap["queued"]["normal"]) == (0, 1)
    await quota(redis, Quota(total=1))
    assert (await scripts.check(M, "b", now_ms=T0)).status == CheckStatus.HELD


async def test_acquire_return_codes(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    await quota(redis, Quota(total=1, queue_max=1))
    admitted = await scripts.acquire(M, "a", N, "t", 1, 10_000, 0, "gw", now_ms=T0)
    assert (admitted.code, admitted.seats, admitted.capacity, admitted.now_ms) == (
        AdmitCode.ADMITTED,
        1,
        1,
        T0,
    )
    assert await take(scripts, "a") == AdmitCode.ALREADY_HELD
    queued = await scripts.acquire(M, "b", N, "t", 1, 10_000, 5000, "gw", now_ms=T0)
    assert (queued.code, queued.ahead) == (AdmitCode.QUEUED, 0)
    assert await take(scripts, "b") == AdmitCode.ALREADY_QUEUED
    assert await take(scripts, "c") == AdmitCode.QUEUE_FULL
    assert await take(scripts, "d", wait_ms=0) == AdmitCode.NO_SEAT
    assert (await scripts.snapshot(M, now_ms=T0))["queued"] == {"low": 0, "normal": 1, "high": 0}


async def test_admission_with_nobody_waiting_leaves_the_state_a_queue_then_grant_would(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    """The fast path (no waiter, seats fit) must end where joining the queue and being granted at
    once ends: a lease, usage, the band's virtual time advanced by the seats, no queue traces."""
    await quota(redis, Quota(total=10))
    await redis.hset(model_keys(M)[9], "vtime:1", 7)
    assert await take(scripts, "a", seats=3, now=T0) == AdmitCode.ADMITTED
    qstate = {k.decode(): int(v) for k, v in (await redis.hgetall(model_keys(M)[9])).items()}
    assert qstate == {"vtime:1": 10, "since:1": T0}
    lease = json.loads(await redis.hget(model_keys(M)[2], "a"))
    assert (lease["s"], lease["b"], lease["t"], lease["g"], lease["w"]) == (3, 1, "t", T0, "gw")
    for key in (*model_keys(M)[4:9], *model_keys(M)[10:13]):  # queues, waiters, deadlines, tags
        assert not await redis.exists(key), key
    # with a waiter in any band the fast path is not taken: queue order still decides
    assert await take(scripts, "h", band=H, seats=8, now=T0) == AdmitCode.QUEUED
    assert await take(scripts, "b", seats=1, now=T0) == AdmitCode.QUEUED


async def test_release_return_codes_and_grant_is_published(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    await quota(redis, Quota(total=1))
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(scripts.channel)
    try:
        await take(scripts, "a")
        await take(scripts, "b")
        await take(scripts, "c")
        released = await scripts.release(M, "a", now_ms=T0 + 40)
        assert (released.code, released.granted, released.hold_ms) == (ReleaseCode.RELEASED, ("b",), 40)
        message = None
        for _ in range(100):  # poll for the message rather than sleep a fixed time
            if message := await pubsub.get_message(timeout=0.05):
                break
        assert message is not None and json.loads(message["data"]) == ["b"]
        assert (await scripts.release(M, "c", now_ms=T0 + 50)).code == ReleaseCode.LEFT_QUEUE
        assert (await scripts.release(M, "c", now_ms=T0 + 50)).code == ReleaseCode.UNKNOWN
        assert (await scripts.release(M, "never", now_ms=T0 + 50)).code == ReleaseCode.UNKNOWN
    finally:
        await pubsub.aclose()


async def test_renew_extends_live_leases_and_reports_lost_ones(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    await take(scripts, "a", lease_ms=100)
    await take(scripts, "b", lease_ms=100, now=T0 + 50)
    await scripts.check(M, "x", now_ms=T0 + 110)  # any call reaps a: its seat is gone
    reply = await scripts.renew(M, ["a", "b", "ghost"], 1000, now_ms=T0 + 120)
    assert reply.lost == ("a", "ghost")  # a expired at T0+100
    assert await redis.zscore(model_keys(M)[1], "b") == T0 + 1120


async def test_check_statuses(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    await quota(redis, Quota(total=1))
    await take(scripts, "a")
    await take(scripts, "b", band=H)
    await take(scripts, "c", band=L)
    assert (await scripts.check(M, "a", now_ms=T0)).status == CheckStatus.HELD
    low = await scripts.check(M, "c", now_ms=T0)
    assert (low.status, low.ahead) == (CheckStatus.QUEUED, 1)  # the high waiter is ahead
    assert (await scripts.check(M, "zz", now_ms=T0)).status == CheckStatus.GONE


async def test_snapshot_reports_usage_per_dimension(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    await take(scripts, "a", band=H, tenant="acme", seats=3)
    await take(scripts, "b", band=L, tenant="bolt")
    snap = await scripts.snapshot(M, now_ms=T0)
    assert snap["used"] == {
        "total": 4,
        "band": {"low": 1, "normal": 0, "high": 3},
        "tenant": {"acme": 3, "bolt": 1},
    }
    assert snap["leases"] == 2


async def test_server_clock_is_used_without_now(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    reply = await scripts.acquire(M, "a", N, "t", 1, 10_000, 0, "gw")
    server_s, _ = await redis.time()
    assert abs(reply.now_ms - server_s * 1000) < 5000


async def test_recovers_after_script_flush(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    assert await take(scripts, "a") == AdmitCode.ADMITTED
    await redis.script_flush()
    assert await take(scripts, "b") == AdmitCode.ADMITTED  # EVALSHA fails, the script is reloaded
    assert (await scripts.snapshot(M, now_ms=T0))["leases"] == 2


# ---- leases, limits, order ----------------------------------------------------------------------


async def test_expired_leases_stop_counting(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    await quota(redis, Quota(total=1))
    await take(scripts, "a", lease_ms=100)
    assert await take(scripts, "b", wait_ms=0, now=T0 + 99) == AdmitCode.NO_SEAT
    assert await take(scripts, "b", wait_ms=0, now=T0 + 100) == AdmitCode.ADMITTED
    assert (await scripts.snapshot(M, now_ms=T0 + 100))["used"]["total"] == 1


async def test_models_are_isolated(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    await quota(redis, Quota(total=1), model="a")
    await quota(redis, Quota(total=1), model="b")
    assert await take(scripts, "x", model="a") == AdmitCode.ADMITTED
    assert await take(scripts, "y", model="a", wait_ms=0) == AdmitCode.NO_SEAT
    assert await take(scripts, "y", model="b", wait_ms=0) == AdmitCode.ADMITTED


@pytest.mark.parametrize(
    ("q", "held", "ask", "code"),
    [
        pytest.param(Quota(total=2), [(N, "t", 2)], (N, "u", 1), AdmitCode.NO_SEAT, id="model total"),
        pytest.param(Quota(tenant=1), [(N, "t", 1)], (N, "t", 1), AdmitCode.NO_SEAT, id="tenant cap"),
        pytest.param(Quota(tenant=1), [(N, "t", 1)], (N, "u", 1), AdmitCode.ADMITTED, id="other tenant"),
        pytest.param(Quota(tenants={"t": 2}, tenant=1), [(N, "t", 1)], (N, "t", 1), AdmitCode.ADMITTED,
                     id="tenant override"),
        pytest.param(Quota(band={L: 1}), [(L, "t", 1)], (L, "u", 1), AdmitCode.NO_SEAT, id="band nominal"),
        pytest.param(Quota(band={H: 1, L: 2}, borrow={H: 1}), [(H, "t", 1)], (H, "t", 1), AdmitCode.ADMITTED,
                     id="high borrows unused low seats"),
        pytest.param(Quota(band={H: 1, L: 2}, borrow={H: 1}), [(H, "t", 2)], (H, "t", 1), AdmitCode.NO_SEAT,
                     id="borrowing ceiling"),
        pytest.param(Quota(band={H: 1, L: 1}, borrow={H: 3}), [(H, "t", 1), (L, "t", 1)], (H, "t", 1),
                     AdmitCode.NO_SEAT, id="nothing unused to borrow"),
        pytest.param(Quota(total=2, count_seats=False), [(N, "t", 5)], (N, "t", 5), AdmitCode.ADMITTED,
                     id="seats off counts requests"),
        pytest.param(Quota(total=3, reserve={H: 1}), [(L, "t", 1)], (L, "t", 1), AdmitCode.ADMITTED,
                     id="low leaves the high reserve free"),
        pytest.param(Quota(total=3, reserve={H: 1}), [(L, "t", 2)], (L, "t", 1), AdmitCode.NO_SEAT,
                     id="low may not take the high reserve"),
        pytest.param(Quota(total=3, reserve={H: 1}), [(L, "t", 2)], (H, "t", 1), AdmitCode.ADMITTED,
                     id="high takes its reserve"),
        pytest.param(Quota(total=3, reserve={H: 2}), [], (L, "t", 3), AdmitCode.ADMITTED,
                     id="a low request is clamped to what the reserve leaves"),
    ],
)  # fmt: skip
async def test_limits(
    redis: aioredis.Redis,
    scripts: AdmissionScripts,
    q: Quota,
    held: list[tuple[Band, str, int]],
    ask: tuple[Band, str, int],
    code: AdmitCode,
) -> None:
    await quota(redis, q)
    for i, (band, tenant, seats) in enumerate(held):
        assert await take(scripts, f"held{i}", band, tenant, seats) == AdmitCode.ADMITTED
    band, tenant, seats = ask
    assert await take(scripts, "ask", band, tenant, seats, wait_ms=0) == code


async def grant_order(scripts: AdmissionScripts, holder: str, start: int, step_ms: int) -> list[str]:
    """Release the holder, then whoever was granted, one at a time; the order of grants."""
    order, current, now = [], holder, start
    while True:
        granted = (await scripts.release(M, current, now_ms=now)).granted
        if not granted:
            return order
        current = granted[0]
        order.append(current)
        now += step_ms


async def test_strict_priority_between_bands(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    await quota(redis, Quota(total=1, aging_ms=0))
    await take(scripts, "run")
    for rid, band in [("low", L), ("normal", N), ("high", H)]:
        await take(scripts, rid, band)
    assert await grant_order(scripts, "run", T0 + 1, 10) == ["high", "normal", "low"]


async def test_aging_lets_a_low_waiter_pass_fresh_high_ones(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    await quota(redis, Quota(total=1, aging_ms=100))
    await take(scripts, "run")
    await take(scripts, "low", L)
    await take(scripts, "high", H, now=T0 + 250)
    order = await grant_order(scripts, "run", T0 + 250, 10)
    assert order == ["low", "high"]  # low waited 2.5 aging periods: priority 2, served earlier than high


async def test_a_freed_seat_that_is_the_reserve_waits_for_a_high_request(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    await quota(redis, Quota(total=2, reserve={H: 1}, aging_ms=0))
    assert await take(scripts, "low0", L) == AdmitCode.ADMITTED
    assert await take(scripts, "high0", H) == AdmitCode.ADMITTED
    assert await take(scripts, "low1", L) == AdmitCode.QUEUED
    assert (await scripts.release(M, "high0", now_ms=T0 + 1)).granted == ()  # the reserve stays free
    assert await take(scripts, "high1", H, now=T0 + 2) == AdmitCode.ADMITTED  # at once, past low1
    assert (await scripts.release(M, "low0", now_ms=T0 + 3)).granted == ()  # high1 + low1 would fill it
    assert (await scripts.release(M, "high1", now_ms=T0 + 4)).granted == ("low1",)


async def test_tenants_take_turns_inside_a_band(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    await quota(redis, Quota(total=1))
    await take(scripts, "run")
    for i in range(4):
        await take(scripts, f"flood{i}", tenant="flood")
    await take(scripts, "polite0", tenant="polite", now=T0 + 1)
    await take(scripts, "polite1", tenant="polite", now=T0 + 1)
    order = await grant_order(scripts, "run", T0 + 2, 1)
    assert order == ["flood0", "polite0", "flood1", "polite1", "flood2", "flood3"]


async def test_expired_waiter_leaves_the_queue(redis: aioredis.Redis, scripts: AdmissionScripts) -> None:
    await quota(redis, Quota(total=1))
    await take(scripts, "run")
    await take(scripts, "w", wait_ms=100)
    assert (await scripts.check(M, "w", now_ms=T0 + 100)).status == CheckStatus.GONE
    assert (await scripts.snapshot(M, now_ms=T0 + 100))["queued"]["normal"] == 0


async def test_a_check_grants_seats_freed_by_expired_leases(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    await quota(redis, Quota(total=1))
    await take(scripts, "crashed", lease_ms=100)  # its gateway died: nobody will release it
    await take(scripts, "w")
    check = await scripts.check(M, "w", now_ms=T0 + 100)
    assert (check.status, check.granted) == (CheckStatus.HELD, ("w",))


async def test_concurrent_acquires_never_exceed_the_total(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    await quota(redis, Quota(total=5))
    codes = await asyncio.gather(*(take(scripts, f"r{i}", wait_ms=0) for i in range(40)))
    assert codes.count(AdmitCode.ADMITTED) == 5
    assert (await scripts.snapshot(M, now_ms=T0))["used"]["total"] == 5


# ---- two-step admission: the chosen worker's own capacity ---------------------------------------


async def test_worker_step_holds_a_request_the_global_gate_would_admit(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    await redis.hset(keys.worker(M, "w1"), "max_concurrency", 1)
    first = await scripts.acquire(M, "a", N, "t", 1, 10_000, 0, "gw", now_ms=T0, worker="w1")
    assert first.code == AdmitCode.ADMITTED
    full = await scripts.acquire(M, "b", N, "t", 1, 10_000, 5000, "gw", now_ms=T0, worker="w1")
    assert full.code == AdmitCode.WORKER_FULL
    snap = await scripts.snapshot(M, now_ms=T0)
    assert snap["leases"] == 1 and sum(snap["queued"].values()) == 0  # nothing taken, nothing queued
    other = await scripts.acquire(M, "b", N, "t", 1, 10_000, 5000, "gw", now_ms=T0, worker="w2")
    assert other.code == AdmitCode.ADMITTED  # re-routed to a worker with room (no capacity known)
    await scripts.release(M, "a", now_ms=T0)
    again = await scripts.acquire(M, "c", N, "t", 1, 10_000, 0, "gw", now_ms=T0, worker="w1")
    assert again.code == AdmitCode.ADMITTED


async def test_claim_places_a_lease_granted_after_waiting(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    await quota(redis, Quota(total=2))
    await redis.hset(keys.worker(M, "w1"), "max_concurrency", 1)
    await scripts.acquire(M, "a", N, "t", 1, 10_000, 0, "gw", now_ms=T0, worker="w1")
    await take(scripts, "b")
    assert (await scripts.claim(M, "b", "w1", now_ms=T0)).code == ClaimCode.WORKER_FULL
    assert (await scripts.claim(M, "b", "w2", now_ms=T0)).code == ClaimCode.PLACED
    assert (await scripts.claim(M, "b", "w2", now_ms=T0)).code == ClaimCode.PLACED  # again: no-op
    assert (await scripts.claim(M, "ghost", "w2", now_ms=T0)).code == ClaimCode.GONE
    used = await redis.hgetall(model_keys(M)[3])
    assert used[b"wreq:w1"] == b"1" and used[b"wreq:w2"] == b"1"
    await scripts.release(M, "b", now_ms=T0)
    assert b"wreq:w2" not in await redis.hgetall(model_keys(M)[3])


async def test_renewal_keeps_an_expired_lease_nobody_reaped(
    redis: aioredis.Redis, scripts: AdmissionScripts
) -> None:
    """After a Redis pause longer than a lease, the holder's renewal comes first: its seat was never
    given away, so it keeps it (and a newcomer is not admitted over the quota)."""
    await quota(redis, Quota(total=1))
    assert await take(scripts, "a", lease_ms=100) == AdmitCode.ADMITTED
    reply = await scripts.renew(M, ["a"], 1000, now_ms=T0 + 500)
    assert reply.lost == ()
    assert await take(scripts, "b", wait_ms=0, now=T0 + 600) == AdmitCode.NO_SEAT
