"""The engine driver: virtual time follows the wall clock scaled, events wake requests, aborts free them."""

from __future__ import annotations

import asyncio

import pytest

from bench.emulator.driver import EngineBroken, EngineDriver, RequestState
from bench.emulator.kv_events import EngineKvEvent
from bench.sim.engine import Engine
from bench.sim.profiles import load_profile, scaled
from runtime.tasks import cancel_and_wait, spawn

PROFILE = scaled(load_profile("h100-llama3.1-8b"), num_gpu_blocks=500)
SCALE = 0.02  # the modelled GPU runs 50x faster than the wall clock


async def until(state: RequestState, condition) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await state.wake.wait()
            state.wake.clear()


@pytest.fixture
async def driver():
    kv: list[EngineKvEvent] = []

    async def sink(events: list[EngineKvEvent]) -> None:
        kv.extend(events)

    d = EngineDriver(Engine(PROFILE, record_kv_events=True), SCALE, stream_interval_s=0.005, kv_sink=sink)
    d.kv_seen = kv  # type: ignore[attr-defined]
    task = spawn(d.run(), name="test-driver")
    yield d
    await cancel_and_wait(task)


def blocks(first_key: int, n: int) -> list[tuple[int, int]]:
    return [(first_key + i, 16) for i in range(n)]


def test_time_scale_must_be_positive() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        EngineDriver(Engine(PROFILE), 0)


async def test_virtual_time_runs_faster_than_the_wall_clock_by_the_scale(driver: EngineDriver) -> None:
    loop = asyncio.get_running_loop()
    v0, w0 = driver.virtual_now(), loop.time()
    await asyncio.sleep(0.05)
    dv, dw = driver.virtual_now() - v0, loop.time() - w0
    assert dv == pytest.approx(dw / SCALE, rel=0.2)


async def test_a_request_gets_its_first_token_then_all_tokens_then_finishes(driver: EngineDriver) -> None:
    state = driver.submit("r1", blocks(1000, 4), output_tokens=2000)
    assert driver.inflight_ids == ["r1"]
    seen: list[int] = []
    await until(state, lambda: state.started)
    while not state.finished:
        seen.append(driver.refresh(state))
        await until(state, lambda n=seen[-1]: state.finished or state.generated > n)
    assert state.cached_tokens == 0
    assert seen == sorted(seen) and seen[0] >= 1
    assert len(set(seen)) > 1  # tokens came in more than one batch
    assert driver.refresh(state) == 2000
    assert driver.inflight_ids == []
    stored = [key for kind, keys in driver.kv_seen if kind == "stored" for key in keys]  # type: ignore[attr-defined]
    assert stored[:4] == [1000, 1001, 1002, 1003]


async def test_a_repeated_prefix_is_cached(driver: EngineDriver) -> None:
    for expected_cached in (0, 48):
        state = driver.submit("r", [*blocks(2000, 3), (99_000 + expected_cached, 5)], output_tokens=2)
        await until(state, lambda s=state: s.finished)
        assert state.cached_tokens == expected_cached


async def test_abort_frees_the_engine_and_is_idempotent(driver: EngineDriver) -> None:
    state = driver.submit("r", blocks(3000, 2), output_tokens=5000)  # fits the 8k-token pool
    await until(state, lambda: state.started)
    assert driver.engine.running == 1
    driver.abort(state)
    driver.abort(state)
    assert state.finished
    assert (driver.engine.running, driver.engine.waiting) == (0, 0)
    assert driver.inflight_ids == []


async def test_clear_cache_always_reports_cleared(driver: EngineDriver) -> None:
    driver.clear_cache()  # nothing cached yet: vLLM still reports AllBlocksCleared
    async with asyncio.timeout(5):
        while ("cleared", []) not in driver.kv_seen:  # type: ignore[attr-defined]
            await asyncio.sleep(0.005)


class EngineThatBreaks(Engine):
    """Fault injection: the engine model raises once a request has started decoding."""

    def advance(self, until_s: float):  # type: ignore[override]
        if self.running:
            raise RuntimeError("engine bug")
        return super().advance(until_s)


async def test_an_engine_failure_fails_every_request_instead_of_hanging() -> None:
    d = EngineDriver(EngineThatBreaks(PROFILE), SCALE, stream_interval_s=0.005)
    task = spawn(d.run(), name="test-driver-breaks")
    try:
        state = d.submit("r", blocks(4000, 2), output_tokens=1000)
        await until(state, lambda: state.failed)
        assert state.finished
        with pytest.raises(EngineBroken, match="engine bug"):
            d.submit("next", blocks(5000, 1), output_tokens=1)
    finally:
        await cancel_and_wait(task)
