"""The Lua scripts and policy.admission.AdmissionState make the same decision on every step.

One random sequence of acquire / release / renew / check / clock steps, under a random quota, goes to
both a real Redis (the `redis` fixture) and the pure model; every reply and, after every step, the
leases, queues and seat counts must be equal (STYLE §7.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.admission import AdmissionState, Quota
from policy.types import Band
from store import keys
from store.scripts import AdmissionScripts, model_keys, quota_key, register_scripts

MODEL = "m"
IDS = [f"r{i:02d}" for i in range(10)]
TENANTS = ["acme", "bolt", "zed"]
WORKERS = ["w1", "w2"]


@dataclass(frozen=True)
class Acquire:
    rid: str
    band: Band
    tenant: str
    seats: int
    lease_ms: int
    max_wait_ms: int
    worker: str = ""  # two-step admission when set


@dataclass(frozen=True)
class Claim:
    rid: str
    worker: str


@dataclass(frozen=True)
class Release:
    rid: str


@dataclass(frozen=True)
class Renew:
    rids: tuple[str, ...]
    lease_ms: int


@dataclass(frozen=True)
class Check:
    rid: str


@dataclass(frozen=True)
class Tick:
    ms: int


ids = st.sampled_from(IDS)
bands = st.sampled_from(list(Band))
steps = st.one_of(
    st.builds(
        Acquire,
        ids,
        bands,
        st.sampled_from(TENANTS),
        st.integers(1, 5),
        st.sampled_from([50, 300, 2000]),
        st.sampled_from([0, 100, 1000, 5000, 5000]),
        st.sampled_from(["", "", *WORKERS]),
    ),
    st.builds(Claim, ids, st.sampled_from(WORKERS)),
    st.builds(Release, ids),
    st.builds(Renew, st.lists(ids, max_size=4).map(tuple), st.sampled_from([100, 1000])),
    st.builds(Check, ids),
    st.builds(Tick, st.sampled_from([0, 50, 100, 100, 250, 300, 1000, 2000])),
)
optional_limit = st.none() | st.integers(0, 6) | st.integers(1, 3)
quotas = st.builds(
    Quota,
    total=optional_limit,
    band=st.dictionaries(bands, st.integers(0, 4)),
    borrow=st.dictionaries(bands, st.integers(0, 4)),
    reserve=st.dictionaries(bands, st.integers(0, 3), max_size=2),
    tenant=optional_limit,
    tenants=st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 5), max_size=2),
    queue_max=st.integers(1, 6),
    queue_max_band=st.dictionaries(bands, st.integers(1, 3), max_size=1),
    aging_ms=st.sampled_from([0, 100, 1000]),
    count_seats=st.booleans(),
)


async def redis_state(redis: aioredis.Redis) -> dict[str, object]:
    keys = model_keys(MODEL)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrange(keys[1], 0, -1, withscores=True).hgetall(keys[3])
        for b in Band:
            pipe.zrange(keys[4 + b], 0, -1)
        leases, used, *queues = await pipe.execute()
    return {
        "leases": {k.decode(): int(v) for k, v in leases},
        "used": {k.decode(): int(v) for k, v in used.items()},
        "queues": [[k.decode() for k in q] for q in queues],
    }


def model_state(model: AdmissionState) -> dict[str, object]:
    usage = model.usage()
    used = {"total": usage.total} if usage.total else {}
    used |= {f"band:{int(b)}": v for b, v in usage.band.items() if v}
    used |= {f"tenant:{t}": v for t, v in usage.tenant.items() if v}
    used |= {f"wreq:{w}": v for w, v in usage.worker.items() if v}
    return {
        "leases": {rid: lease.expiry_ms for rid, lease in model.leases.items()},
        "used": used,
        "queues": [model.queue(b) for b in Band],
    }


async def apply(
    scripts: AdmissionScripts, model: AdmissionState, step: object, now: int, caps: dict[str, int]
) -> tuple[object, object]:
    hold = model.hold_ms or 0
    match step:
        case Acquire(rid, band, tenant, seats, lease_ms, max_wait_ms, worker):
            r = await scripts.acquire(
                MODEL,
                rid,
                band,
                tenant,
                seats,
                lease_ms,
                max_wait_ms,
                "gw",
                now_ms=now,
                worker=worker or None,
            )
            m = model.acquire(
                now, rid, band, tenant, seats, lease_ms, max_wait_ms, worker, caps.get(worker, 0)
            )
            cap = -1 if model.quota.total is None else model.quota.total
            return (r.code, r.seats, r.ahead, r.granted, r.hold_ms, r.capacity, r.now_ms), (
                m.code, m.seats, m.ahead, m.granted, model.hold_ms or 0, cap, now,
            )  # fmt: skip
        case Release(rid):
            rr = await scripts.release(MODEL, rid, now_ms=now)
            mr = model.release(now, rid)
            return (rr.code, rr.granted, rr.hold_ms), (mr.code, mr.granted, model.hold_ms or 0)
        case Renew(rids, lease_ms):
            rn = await scripts.renew(MODEL, rids, lease_ms, now_ms=now)
            return (rn.lost, rn.granted), model.renew(now, list(rids), lease_ms)
        case Claim(rid, worker):
            rl = await scripts.claim(MODEL, rid, worker, now_ms=now)
            return (rl.code, rl.granted), model.claim(now, rid, worker, caps.get(worker, 0))
        case Check(rid):
            rc = await scripts.check(MODEL, rid, now_ms=now)
            mc = model.check(now, rid)
            return (rc.status, rc.ahead, rc.granted, rc.hold_ms), (mc.status, mc.ahead, mc.granted, hold)
    raise AssertionError(step)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    quota=quotas,
    caps=st.fixed_dictionaries({w: st.integers(0, 2) for w in WORKERS}),
    sequence=st.lists(steps, min_size=1, max_size=60),
)
async def test_lua_scripts_and_pure_model_agree(
    redis: aioredis.Redis, quota: Quota, caps: dict[str, int], sequence: list[object]
) -> None:
    await redis.flushdb()
    await redis.hset(quota_key(MODEL), mapping=quota.to_hash())
    for worker, cap in caps.items():
        await redis.hset(keys.worker(MODEL, worker), "max_concurrency", cap)
    scripts = register_scripts(redis)
    model = AdmissionState(quota=Quota.from_hash(quota.to_hash()))
    now = 1_000_000
    for i, step in enumerate(sequence):
        if isinstance(step, Tick):
            now += step.ms
            continue
        lua, pure = await apply(scripts, model, step, now, caps)
        assert lua == pure, f"step {i} {step}: lua {lua} != model {pure}"
        assert await redis_state(redis) == model_state(model), f"state after step {i} {step}"


@pytest.mark.parametrize(
    "quota",
    [
        pytest.param(Quota(), id="empty quota"),
        pytest.param(
            Quota(
                total=8,
                band={Band.HIGH: 4},
                borrow={Band.HIGH: 2},
                tenant=3,
                tenants={"a:b": 1},
                queue_max=7,
                queue_max_band={Band.LOW: 2},
                aging_ms=0,
                count_seats=False,
            ),
            id="every field",
        ),
    ],
)
def test_quota_round_trips_through_the_redis_hash(quota: Quota) -> None:
    assert Quota.from_hash(quota.to_hash()) == quota
