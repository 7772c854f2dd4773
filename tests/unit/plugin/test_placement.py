"""Two-step admission (plugin/admit.py, plugin/placement.py) on the request-path parts alone.

Real Redis and the real slot pool, with only the parts a request passes through before it reaches a
worker (Intake, Admission, Dispatch; Release to give a lease back) over a `GatewayContext`
(tests/unit/plugin/parts.py), no addon. The workers are registry entries with `max_concurrency = 1`
and round-robin routing (w0 first), so which worker is chosen is known. "Another gateway" is a second
SlotPool on the same Redis that fills a worker without this gateway knowing (its in-flight view is
its own), which is exactly the case step two exists for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from mitmproxy import http
from mitmproxy.test import tutils

from plugin.admit import Admission
from plugin.context import GatewayContext
from plugin.dispatch import Dispatch
from plugin.flow import state_of
from plugin.intake import Intake
from plugin.mirror import wall_ms
from plugin.quotas import write_quota
from plugin.release import Release
from policy.admission import Quota
from policy.types import Band
from store import registry
from store.registry import WorkerRecord
from store.slots import Lease, SlotPool, Ticket
from tests.polling import until
from tests.unit.plugin.parts import gateway_context
from tests.unit.plugin.test_addon import MODEL, error_of, request_flow


class Gate:
    """The parts in the addon's order, over one context: `request` as the request hook runs them."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx, self.metrics, self.pool, self.router = ctx, ctx.metrics, ctx.pool, ctx.router
        self.process, self.config = ctx.process, ctx.config
        dispatch = Dispatch(
            collect_usage=ctx.config.streaming.collect_usage, metrics=ctx.metrics,
            upstream_key=ctx.config.gateway.upstream_key,
        )  # fmt: skip
        self.parts = (Intake(ctx), Admission(ctx), dispatch)
        self.release = Release(ctx)

    async def request(self, flow: http.HTTPFlow) -> None:
        for part in self.parts:
            await part.request(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self.release.response(flow)

    def client_disconnected(self, flow: http.HTTPFlow) -> None:
        self.process.client_left(flow.client_conn.id)  # as the addon's client_disconnected hook

    @property
    def releases(self) -> int:
        return self.ctx.releaser.released


async def setup(redis: aioredis.Redis, mode: str, **model: Any) -> dict[str, Any]:
    """Two workers of capacity 1, a quota with room for 10, round-robin routing; the config dict."""
    now = wall_ms()
    for i in range(2):
        record = WorkerRecord(id=f"w{i}", model=MODEL, url=f"http://10.1.2.{i}:8000", max_concurrency=1)
        await registry.register(redis, record, 60_000, now)
    await write_quota(redis, MODEL, Quota(total=10, count_seats=False))
    return {
        "models": {MODEL: {"total": 10, "on_worker_full": mode, **model}},
        "routing": {"policy": "round_robin"},
        "decision_log": {"redis_stream": False},
        "admission": {"audit_every_ms": 0},
    }


@asynccontextmanager
async def running_parts(redis: aioredis.Redis, config: dict[str, Any]) -> AsyncIterator[Gate]:
    async with gateway_context(redis, config) as ctx:
        assert ctx.workers.mirror is not None
        await ctx.workers.mirror.refresh()
        yield Gate(ctx)


@pytest.fixture
async def other(redis: aioredis.Redis) -> AsyncIterator[SlotPool]:
    async with SlotPool(redis, gateway_id="other") as pool:
        yield pool


async def fill(pool: SlotPool, worker: str, n: int = 1) -> list[Lease]:
    """Requests of another gateway placed on `worker`."""
    return [
        await pool.acquire(Ticket(f"other-{worker}-{i}", MODEL, Band.NORMAL, "t"), worker=worker)
        for i in range(n)
    ]


@pytest.fixture(params=["reroute", "wait"])
async def gate(request: pytest.FixtureRequest, redis: aioredis.Redis) -> AsyncIterator[Gate]:
    async with running_parts(redis, await setup(redis, request.param)) as parts:
        yield parts


def full_events(gate: Gate) -> float:
    return sum(gate.metrics.worker_full.get(MODEL, w) for w in ("w0", "w1"))


def mode(gate: Gate) -> str:
    return gate.config.models[MODEL].on_worker_full


def held(flow: http.HTTPFlow) -> dict[str, object]:
    state = state_of(flow)
    assert state is not None
    return state.held.record() if state.held is not None else {}


async def test_worker_with_room_is_placed_in_one_step(gate: Gate) -> None:
    flow = request_flow()
    await gate.request(flow)
    state = state_of(flow)
    assert state is not None and state.route is not None and state.lease is not None
    assert state.route.worker.id == state.lease.worker == "w0"
    assert held(flow) == {}  # admitted at once: nothing held it
    assert gate.metrics.worker_full.get(MODEL, "w0") == 0


async def test_full_worker_reroutes_or_waits_for_it(gate: Gate, other: SlotPool) -> None:
    (blocker,) = await fill(other, "w0")
    flow = request_flow()
    task = asyncio.ensure_future(gate.request(flow))
    if mode(gate) == "reroute":
        await task
        expect = {"held_by": "worker", "reroutes": 1, "worker_full": 1}
        worker = "w1"
    else:
        await until(lambda: gate.metrics.worker_full.get(MODEL, "w0") == 1, "w0 to turn it down")
        assert not task.done() and gate.pool.held() == 1  # holds its seat while waiting for w0
        assert gate.router.model(MODEL).inflight["w1"] == 0  # and did not go to the idle w1
        await other.release(blocker)  # another gateway's release: found by the re-check
        await asyncio.wait_for(task, 5)
        expect = {"held_by": "worker", "reroutes": 0, "worker_full": 1}
        worker = "w0"
    state = state_of(flow)
    assert state is not None and state.route is not None and state.lease is not None
    assert (state.route.worker.id, state.lease.worker) == (worker, worker)
    assert held(flow) == expect
    assert gate.metrics.worker_full.get(MODEL, "w0") == 1
    assert flow.request.host == f"10.1.2.{worker[1]}"


async def test_every_worker_full_waits_for_the_first_that_frees(gate: Gate, other: SlotPool) -> None:
    leases = {w: (await fill(other, w))[0] for w in ("w0", "w1")}
    flow = request_flow()
    task = asyncio.ensure_future(gate.request(flow))
    tried = 2 if mode(gate) == "reroute" else 1
    await until(lambda: full_events(gate) >= tried, "the full workers to turn it down")
    assert not task.done()
    await other.release(leases["w0"] if mode(gate) == "wait" else leases["w1"])
    await asyncio.wait_for(task, 5)
    state = state_of(flow)
    assert state is not None and state.lease is not None
    assert state.lease.worker == ("w0" if mode(gate) == "wait" else "w1")
    assert held(flow)["held_by"] == "worker"


async def test_disconnect_while_waiting_for_a_worker_frees_the_seat(gate: Gate, other: SlotPool) -> None:
    await fill(other, "w0")
    await fill(other, "w1")
    flow = request_flow()
    task = asyncio.ensure_future(gate.request(flow))
    await until(lambda: gate.pool.held() == 1, "a seat held while waiting for a worker")
    gate.client_disconnected(flow)
    await asyncio.wait_for(task, 5)
    assert flow.error is not None and flow.response is None  # killed: never reaches a worker
    assert state_of(flow).route is None  # type: ignore[union-attr]
    await until(lambda: gate.pool.held() == 0, "the seat to be released")
    assert gate.releases == 1
    assert sum(gate.router.model(MODEL).inflight.values()) == 0
    snap = await gate.pool.snapshot(MODEL)
    assert snap["used"]["total"] == 2  # only the other gateway's two requests


async def test_no_wait_budget_and_every_worker_full_is_rejected(gate: Gate, other: SlotPool) -> None:
    await fill(other, "w0")
    await fill(other, "w1")
    flow = request_flow(headers={"x-kvgate-max-wait-ms": "0"})
    await gate.request(flow)
    assert error_of(flow) == (503, "worker_full")
    assert gate.pool.held() == 0 and gate.releases == 0
    assert sum(gate.router.model(MODEL).inflight.values()) == 0


async def test_release_of_a_placed_lease_frees_its_worker(gate: Gate) -> None:
    first = request_flow()
    await gate.request(first)  # w0
    second = request_flow()
    await gate.request(second)  # w1
    third = request_flow()
    task = asyncio.ensure_future(gate.request(third))  # both full: waits
    await until(lambda: full_events(gate) >= 1, "the third request to find the workers full")
    first.response = tutils.tresp(content=b"{}")
    gate.response(first)  # this gateway's release wakes the waiter
    await asyncio.wait_for(task, 5)
    state = state_of(third)
    assert state is not None and state.lease is not None and state.lease.worker == "w0"


async def test_queued_for_a_seat_then_routed_again_and_placed(gate: Gate, other: SlotPool) -> None:
    # the quota (10) is full: 9 requests of another gateway nowhere in particular, one on w1
    loose = [await other.acquire(Ticket(f"loose-{i}", MODEL, Band.NORMAL, "t")) for i in range(9)]
    (on_w1,) = await fill(other, "w1")
    flow = request_flow()
    task = asyncio.ensure_future(gate.request(flow))  # round robin: w0, which has room: queued for a seat
    await until(lambda: gate.process.waiters != {}, "the request to queue")
    await until(lambda: sum(gate.router.model(MODEL).inflight.values()) == 0, "the reservation back")
    await other.release(loose[0])  # a seat frees: granted, routed again (round robin: w1, full)
    if mode(gate) == "reroute":
        await asyncio.wait_for(task, 5)  # -> the next worker, w0
        worker, expect = "w0", {"held_by": "worker", "reroutes": 1, "worker_full": 1}
    else:
        await until(lambda: gate.metrics.worker_full.get(MODEL, "w1") == 1, "w1 to turn it down")
        assert not task.done()
        await other.release(on_w1)
        await asyncio.wait_for(task, 5)
        worker, expect = "w1", {"held_by": "worker", "reroutes": 0, "worker_full": 1}
    state = state_of(flow)
    assert state is not None and state.lease is not None and state.route is not None
    assert (state.lease.worker, state.route.worker.id) == (worker, worker)
    assert held(flow) == expect
    assert gate.router.model(MODEL).inflight == {"w0": int(worker == "w0"), "w1": int(worker == "w1")}


async def test_reroute_finds_a_free_worker_beyond_its_attempts_without_waiting(
    redis: aioredis.Redis, other: SlotPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import plugin.placement

    config = await setup(redis, "reroute", reroute_attempts=0)
    monkeypatch.setattr(plugin.placement, "WORKER_RECHECK_S", 60.0)  # no periodic re-check to rescue it
    (blocker,) = await fill(other, "w0")
    async with running_parts(redis, config) as addon:
        flow = request_flow()
        # w0 (the first choice) is full and no attempt is left: the request takes a seat to wait
        # with, and then tries the workers not found full before waiting for any sign of room
        await asyncio.wait_for(addon.request(flow), 5)
        state = state_of(flow)
        assert state is not None and state.lease is not None and state.lease.worker == "w1"
        assert held(flow)["held_by"] == "worker"
    await other.release(blocker)
