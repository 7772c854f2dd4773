"""Shared fixtures: one real, embedded redis-server for the whole session (DESIGN.md: no mocks)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from hypothesis import settings

from runtime import compat
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


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client on a flushed database; closed after the test."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=False)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.flushdb()
        await client.aclose()
