"""The worker registry on a real Redis: round trip, leases with explicit time, drain, epochs, pruning."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from store import keys, registry
from store.connect import redis_from_url
from store.registry import WorkerRecord

pytestmark = pytest.mark.redis_cluster  # each test on standalone Redis and on a cluster

MODEL = "llama-8b"


def record(worker_id: str = "w1", **overrides: object) -> WorkerRecord:
    fields: dict[str, object] = {
        "id": worker_id,
        "model": MODEL,
        "url": f"http://127.0.0.1:80{worker_id[-1]}",
        "max_concurrency": 32,
        "capacity_tokens": 16 * 1000,
        "block_size": 16,
        "num_gpu_blocks": 1000,
    }
    fields.update(overrides)
    return WorkerRecord(**fields)  # type: ignore[arg-type]


async def test_register_then_read_round_trips_every_field(redis: aioredis.Redis) -> None:
    epoch = await registry.register(
        redis,
        record(running=3, waiting=1, kv_usage=0.25, inflight_ids=("a", "b")),
        lease_ms=4000,
        now_ms=1000,
    )
    [got] = await registry.read_workers(redis, MODEL, now_ms=1500)
    assert got == record(
        running=3,
        waiting=1,
        kv_usage=0.25,
        inflight_ids=("a", "b"),
        models=(MODEL,),
        joined_ms=1000,
        updated_ms=1000,
        epoch=epoch,
        lease_expiry_ms=5000,
        live=True,
    )
    assert await registry.list_models(redis) == [MODEL]
    assert await registry.read_worker(redis, MODEL, "w1", now_ms=1500) == got


async def test_works_with_a_decoding_client(redis_url: str, redis: aioredis.Redis) -> None:
    client = redis_from_url(redis_url, decode_responses=True)
    try:
        await registry.register(client, record(), lease_ms=1000, now_ms=0)
        [got] = await registry.read_workers(client, MODEL, now_ms=10)
        assert got.url == "http://127.0.0.1:801"
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("now_ms", "live"),
    [
        pytest.param(4999, True, id="just before expiry: live"),
        pytest.param(5000, False, id="at expiry: expired"),
        pytest.param(9000, False, id="long after expiry: still listed, not live"),
    ],
)
async def test_lease_expiry_is_reported_not_hidden(redis: aioredis.Redis, now_ms: int, live: bool) -> None:
    await registry.register(redis, record(), lease_ms=4000, now_ms=1000)
    [got] = await registry.read_workers(redis, MODEL, now_ms=now_ms)
    assert got.live is live


async def test_heartbeat_renews_lease_and_writes_load(redis: aioredis.Redis) -> None:
    await registry.register(redis, record(), lease_ms=4000, now_ms=1000)
    draining = await registry.heartbeat(
        redis,
        MODEL,
        "w1",
        running=5,
        waiting=2,
        kv_usage=0.5,
        inflight_ids=["r1"],
        lease_ms=4000,
        now_ms=4500,
    )
    assert draining is False
    [got] = await registry.read_workers(redis, MODEL, now_ms=6000)
    assert (got.live, got.lease_expiry_ms, got.running, got.waiting, got.kv_usage) == (True, 8500, 5, 2, 0.5)
    assert (got.inflight_ids, got.updated_ms, got.joined_ms) == (("r1",), 4500, 1000)


async def test_heartbeat_of_unknown_worker_asks_to_register(redis: aioredis.Redis) -> None:
    reply = await registry.heartbeat(
        redis, MODEL, "ghost", running=0, waiting=0, kv_usage=0, lease_ms=1, now_ms=1
    )
    assert reply is None
    assert await registry.read_workers(redis, MODEL, now_ms=0) == []


async def test_drain_flag_is_returned_by_heartbeat_and_survives_it(redis: aioredis.Redis) -> None:
    await registry.register(redis, record(), lease_ms=4000, now_ms=0)
    assert await registry.set_draining(redis, MODEL, "w1", True) is True
    beat = await registry.heartbeat(
        redis, MODEL, "w1", running=1, waiting=0, kv_usage=0, lease_ms=4000, now_ms=1
    )
    assert beat is True
    [got] = await registry.read_workers(redis, MODEL, now_ms=2)
    assert got.draining is True
    assert await registry.set_draining(redis, MODEL, "w1", False) is True
    assert (await registry.read_workers(redis, MODEL, now_ms=2))[0].draining is False
    assert await registry.set_draining(redis, MODEL, "nobody", True) is False


async def test_each_registration_and_bump_starts_a_new_epoch(redis: aioredis.Redis) -> None:
    first = await registry.register(redis, record(), lease_ms=4000, now_ms=0)
    second = await registry.register(redis, record(), lease_ms=4000, now_ms=10)
    bumped = await registry.bump_epoch(redis, MODEL, "w1")
    assert first < second < bumped
    assert (await registry.read_workers(redis, MODEL, now_ms=11))[0].epoch == bumped
    assert await registry.bump_epoch(redis, MODEL, "nobody") == 0


async def test_deregister_removes_worker_and_model_with_its_last_worker(redis: aioredis.Redis) -> None:
    await registry.register(redis, record("w1"), lease_ms=4000, now_ms=0)
    await registry.register(redis, record("w2"), lease_ms=4000, now_ms=0)
    assert await registry.deregister(redis, MODEL, "w1") is True
    assert [r.id for r in await registry.read_workers(redis, MODEL, now_ms=1)] == ["w2"]
    assert await registry.list_models(redis) == [MODEL]
    assert await registry.deregister(redis, MODEL, "w2") is True
    assert await registry.deregister(redis, MODEL, "w2") is False
    assert await registry.list_models(redis) == []
    assert await redis.exists(keys.worker(MODEL, "w1"), keys.workers(MODEL)) == 0


async def test_prune_removes_only_workers_expired_past_the_grace(redis: aioredis.Redis) -> None:
    await registry.register(redis, record("w1"), lease_ms=1000, now_ms=0)  # expires at 1000
    await registry.register(redis, record("w2"), lease_ms=5000, now_ms=0)  # expires at 5000
    assert await registry.prune_expired(redis, MODEL, now_ms=1500, grace_ms=1000) == []
    assert await registry.prune_expired(redis, MODEL, now_ms=2500, grace_ms=1000) == ["w1"]
    assert [r.id for r in await registry.read_workers(redis, MODEL, now_ms=2500)] == ["w2"]


async def test_models_of_lists_only_routable_workers() -> None:
    records = [
        record("w1", models=("a", "b")),
        record("w2", models=("c",), draining=True),
        record("w3", models=("d",), live=False),
    ]
    assert registry.models_of(records) == ["a", "b"]


async def test_model_with_braces_is_rejected(redis: aioredis.Redis) -> None:
    with pytest.raises(ValueError, match="braces"):
        await registry.register(redis, record(model="bad{x}"), lease_ms=1, now_ms=0)
