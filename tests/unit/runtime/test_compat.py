"""runtime.compat: a cancel landing as `asyncio.wait_for`'s inner await completes is raised, on any Python.

Python 3.11's own `wait_for` drops it (CPython gh-86296); entry points (and tests/conftest.py) install
the 3.12 behaviour.
Without it, the Redis loop below never stops on 3.11 and the first test's task returns 1 instead of raising.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import redis.asyncio as aioredis

from runtime import compat
from runtime.tasks import cancel_and_wait, spawn


async def test_a_cancel_in_the_tick_the_inner_await_completes_is_raised() -> None:
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = spawn(asyncio.wait_for(inner, 10), name="waits")
    await asyncio.sleep(0)  # the task is now suspended inside wait_for
    inner.set_result(1)
    task.cancel()  # same tick: 3.11's wait_for wakes up, sees the result and returns it
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_redis_loop_stops_whatever_tick_the_cancel_lands_in(redis: aioredis.Redis) -> None:
    async def loop_on_redis() -> None:
        while True:
            await redis.set("compat:k", "v", px=1000)  # redis-py sends through asyncio.wait_for

    for ticks in range(40):
        task = spawn(loop_on_redis(), name="redis-loop")
        for _ in range(ticks):
            await asyncio.sleep(0)
        stopping = spawn(cancel_and_wait(task), name="stop")
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert done, f"the loop ignored a cancel {ticks} ticks in"


@pytest.mark.parametrize(
    ("timeout", "inner_s"),
    [pytest.param(0.01, 10.0, id="elapses"), pytest.param(0, 10.0, id="zero timeout")],
)
async def test_timeouts_still_raise_timeout_error(timeout: float, inner_s: float) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.sleep(inner_s), timeout)


async def test_results_pass_through() -> None:
    assert await asyncio.wait_for(asyncio.sleep(0, result="r"), 5) == "r"
    assert await asyncio.wait_for(asyncio.sleep(0, result="r"), None) == "r"


def test_installed_only_where_the_stdlib_needs_it() -> None:
    assert (asyncio.wait_for is compat.wait_for) == (sys.version_info < (3, 12))
