"""plugin/workers.py: the skip-refused-worker rule, on a real mirror of a real registry."""

from __future__ import annotations

from types import SimpleNamespace

import redis.asyncio as aioredis

from plugin.mirror import ClusterMirror, wall_ms
from plugin.workers import WorkerPool
from store import registry
from store.registry import WorkerRecord


async def test_a_refusing_worker_is_skipped_unless_it_is_the_last(redis: aioredis.Redis) -> None:
    for wid in ("a", "b"):
        await registry.register(
            redis, WorkerRecord(id=wid, model="m", url=f"http://{wid}:1"), 60_000, wall_ms()
        )
    mirror = ClusterMirror(redis, refresh_ms=60_000)
    await mirror.refresh()
    pool = WorkerPool(mirror)
    assert [w.id for w in pool.known("m")] == ["a", "b"] == [w.id for w in pool.routable("m")]
    pool.suspect(SimpleNamespace(model="m", worker=pool.routable("m")[0]))  # type: ignore[arg-type]  # a refused
    assert [w.id for w in pool.routable("m")] == ["b"]
    pool.suspect(SimpleNamespace(model="m", worker=pool.routable("m")[0]))  # type: ignore[arg-type]  # b too
    assert [w.id for w in pool.routable("m")] == ["a", "b"]  # none would be left: all of them
    assert WorkerPool(None).routable("m") == [] == WorkerPool(None).known("m")
