"""The registry/index mirror against a real Redis: workers appear, leases expire, index ops flow."""

from __future__ import annotations

import redis.asyncio as aioredis

from plugin.mirror import ClusterMirror, wall_ms
from store import index_store, registry
from store.registry import WorkerRecord
from tests.polling import until


async def test_mirror_follows_registry_and_index(redis: aioredis.Redis) -> None:
    ops: list[tuple[str, index_store.IndexOp]] = []
    resets: list[tuple[str, str]] = []
    now = wall_ms()
    await registry.register(redis, WorkerRecord(id="a", model="m", url="http://127.0.0.1:1"), 60_000, now)
    await registry.register(redis, WorkerRecord(id="b", model="m", url="http://127.0.0.1:2", draining=True),
                            60_000, now)  # fmt: skip
    await index_store.add_blocks(redis, "m", "a", [1, 2, 3], now)
    mirror = ClusterMirror(redis, refresh_ms=50, tail_block_ms=50,
                           on_index_ops=lambda m, batch: ops.extend((m, op) for op in batch),
                           on_worker_reset=lambda m, w: resets.append((m, w)))  # fmt: skip
    await mirror.start()
    try:
        assert [w.id for w in mirror.workers("m")] == ["a", "b"]
        assert [w.id for w in mirror.routable("m")] == ["a"]  # b drains
        assert mirror.served_models() == ["m"]
        await until(lambda: any(op.op == "add" and op.worker == "a" for _, op in ops))  # snapshot
        await index_store.add_blocks(redis, "m", "a", [9], wall_ms())
        await until(lambda: any(op.hashes == (9,) for _, op in ops))  # tailed from the log
        await registry.register(redis, WorkerRecord(id="a", model="m", url="http://127.0.0.1:1"), 60_000,
                                wall_ms())  # fmt: skip  # new epoch
        await until(lambda: ("m", "a") in resets)
        await registry.deregister(redis, "m", "b")
        await until(lambda: ("m", "b") in resets)
        assert mirror.routable("m", now_ms=wall_ms() + 120_000) == []  # leases expire
    finally:
        await mirror.close()


async def test_registry_lost_keeps_known_workers(redis: aioredis.Redis) -> None:
    """A registry wiped (Redis restarted empty) does not make a known model vanish: its non-draining
    workers stay routable until their last-read lease runs out, then known but not routable (503, not
    404); a draining worker that deregistered is dropped at once."""
    now = wall_ms()
    await registry.register(redis, WorkerRecord(id="a", model="m", url="http://127.0.0.1:1"), 2_000, now)
    await registry.register(redis, WorkerRecord(id="b", model="m", url="http://127.0.0.1:2", draining=True),
                            2_000, now)  # fmt: skip
    mirror = ClusterMirror(redis, refresh_ms=50, tail_index=False)
    await mirror.start()
    try:
        await redis.flushall()
        await mirror.refresh()
        assert [w.id for w in mirror.workers("m")] == ["a"]
        assert [w.id for w in mirror.routable("m")] == ["a"]
        assert mirror.routable("m", now_ms=now + 3_000) == []  # its lease ran out: known, not routable
        assert [w.id for w in mirror.workers("m")] == ["a"]
    finally:
        await mirror.close()
