"""runtime.tasks: `every` steps on through the errors it expects; `Background` starts and stops."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from runtime.tasks import Background, every


async def test_every_passes_expected_errors_on_and_keeps_stepping() -> None:
    calls: list[float] = []
    failures: list[Exception] = []
    loop = asyncio.get_running_loop()

    async def step() -> None:
        calls.append(loop.time())
        if len(calls) % 2:
            raise ConnectionError("down")  # an OSError

    task = Background("every-test")
    assert not task.running
    task.start(every(0.01, step, errors=(OSError,), on_error=failures.append))
    assert task.running
    while len(calls) < 4:
        await asyncio.sleep(0.005)
    await task.stop()
    assert not task.running
    count = len(calls)
    await asyncio.sleep(0.05)
    assert len(calls) == count  # stopped means no more steps
    assert [str(e) for e in failures] == ["down"] * ((count + 1) // 2)
    assert all(b - a >= 0.009 for a, b in itertools.pairwise(calls))  # one period apart


async def test_every_with_wait_first_waits_one_period_before_the_first_step() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    first = loop.create_future()

    async def step() -> None:
        if not first.done():
            first.set_result(loop.time())

    task = Background("wait-first")
    task.start(every(0.05, step, errors=(), on_error=lambda e: None, wait_first=True))
    assert await asyncio.wait_for(first, 5) - started >= 0.049
    await task.stop()


async def test_every_ends_on_an_error_it_was_not_told_to_expect() -> None:
    async def step() -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        await every(0.01, step, errors=(OSError,), on_error=lambda e: None)
