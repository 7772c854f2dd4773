"""Shared fixtures: one real, embedded redis-server for the whole session (DESIGN.md: no mocks)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from hypothesis import settings

from runtime import compat
from store.connect import redis_from_url
from store.redis_cluster import EmbeddedRedisCluster
from store.redis_server import EmbeddedRedis

compat.install()  # the tests' entry point: the same process-wide fixes as `kvgate` (runtime/)

# CI runs on a shared 2-core machine: property tests must not fail on timing, and a red build must
# be reproducible, so CI explores a fixed set of examples (locally, hypothesis keeps exploring).
settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[EmbeddedRedisCluster]:
    """A real 3-master Redis Cluster from the same binary, started once, on first use."""
    with EmbeddedRedisCluster(3) as cluster:
        yield cluster


REDIS_BACKENDS = ("standalone", "cluster")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked `redis_cluster` (or in a module marked so) that uses Redis runs twice: on the
    standalone server and on the 3-master cluster (ids `[standalone]`, `[cluster]`)."""
    if "redis_backend" in metafunc.fixturenames and metafunc.definition.get_closest_marker("redis_cluster"):
        metafunc.parametrize("redis_backend", REDIS_BACKENDS)


@pytest.fixture
def redis_backend() -> str:
    return "standalone"


@pytest.fixture
def redis_url(request: pytest.FixtureRequest, redis_backend: str) -> str:
    """The URL of the shared standalone server, or of the shared cluster (`redis+cluster://`)."""
    if redis_backend == "cluster":
        cluster: EmbeddedRedisCluster = request.getfixturevalue("redis_cluster")
        return cluster.url
    server: EmbeddedRedis = request.getfixturevalue("redis_server")
    return server.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client on a flushed database (every master of a cluster); closed after the test."""
    client = redis_from_url(redis_url, decode_responses=False)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.flushdb()
        await client.aclose()
