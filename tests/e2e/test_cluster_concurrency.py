"""The admission scripts under concurrency on the real 3-master Redis Cluster (issue 11, item 6).

A fresh cluster client gets 32 acquire+release loops at once from its first command, as a gateway
does when traffic arrives right after startup, on models whose hash tags fall on all three masters.
With redis-py's default `reinitialize_steps=5` this failed: the first commands of a client still
learning the slot map draw MOVED replies, every fifth MOVED made redis-py close every connection
(`RedisCluster.aclose()`) under the tasks still using them, and those tasks saw `ConnectionError:
Connection closed by server` and `TypeError: 'NoneType' object is not callable` (a write on a
transport already closed: CPython 3.13.0, redis-py 8.1.0). store/connect.py sets
`reinitialize_steps=0` (docs/REDIS.md, Redis Cluster).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from redis.asyncio.cluster import RedisCluster

from bench.cluster_scale import spread_models
from policy.admission import Quota
from policy.types import Band
from store.connect import redis_from_url
from store.redis_cluster import EmbeddedRedisCluster
from store.scripts import register_scripts
from store.slots import set_quota

pytestmark = pytest.mark.e2e

CONCURRENCY = 32
ROUNDS = 60


async def test_admission_scripts_at_concurrency_32_on_a_fresh_cluster_client(
    redis_cluster: EmbeddedRedisCluster,
) -> None:
    models = spread_models(3)
    setup = redis_from_url(redis_cluster.url)
    for model in models:
        await set_quota(setup, model, Quota())
    await setup.aclose()

    client = redis_from_url(redis_cluster.url)  # fresh: no slot map yet when the loops start
    assert isinstance(client, RedisCluster)
    scripts = register_scripts(client)
    errors: Counter[str] = Counter()
    done = 0

    async def loop(k: int) -> None:
        nonlocal done
        for i in range(ROUNDS):
            model, rid = models[(k + i) % len(models)], f"cc-{k}-{i}"
            try:
                await scripts.acquire(model, rid, Band.NORMAL, "t", 1, 10_000, 0, "cc")
                await scripts.release(model, rid)
                done += 1
            except Exception as e:  # every failure is counted and shown, none hidden
                errors[f"{type(e).__name__}: {e}"] += 1

    try:
        await asyncio.gather(*(loop(k) for k in range(CONCURRENCY)))
    finally:
        await scripts.aclose()
        await client.aclose()
    assert not errors, dict(errors)
    assert done == CONCURRENCY * ROUNDS
