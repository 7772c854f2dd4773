"""Admission alone (plugin/admit.py), after Intake: a lease on the chosen worker, counted in Redis,
or a clear 429 that holds nothing. Real Redis and slot pool; no addon (tests/unit/plugin/parts.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from mitmproxy import http

from plugin.admit import Admission
from plugin.context import GatewayContext
from plugin.flow import state_of
from plugin.intake import Intake
from plugin.mirror import wall_ms
from plugin.quotas import write_quota
from policy.admission import Quota
from store import registry
from store.registry import WorkerRecord
from tests.unit.plugin.parts import gateway_context
from tests.unit.plugin.test_addon import MODEL, error_of, request_flow

CONFIG = {
    "models": {MODEL: {"total": 2}},
    "routing": {"policy": "round_robin"},
    "decision_log": {"redis_stream": False},
    "admission": {"audit_every_ms": 0},
}


@pytest.fixture
async def ctx(redis: aioredis.Redis) -> AsyncIterator[GatewayContext]:
    await registry.register(
        redis, WorkerRecord(id="w0", model=MODEL, url="http://10.1.2.3:8000"), 60_000, wall_ms()
    )
    await write_quota(redis, MODEL, Quota(total=2, count_seats=False))
    async with gateway_context(redis, CONFIG) as context:
        assert context.workers.mirror is not None
        await context.workers.mirror.refresh()
        yield context


async def admit(ctx: GatewayContext, flow: http.HTTPFlow) -> http.HTTPFlow:
    await Intake(ctx).request(flow)
    await Admission(ctx).request(flow)
    return flow


async def test_an_admitted_request_holds_a_lease_on_its_worker_in_redis(ctx: GatewayContext) -> None:
    flow = await admit(ctx, request_flow())
    state = state_of(flow)
    assert flow.response is None and state is not None
    assert state.lease is not None and state.route is not None and state.route.worker.id == "w0"
    assert state.held is None  # a seat and the worker were free: admitted at once, not held
    snap = await ctx.pool.snapshot(MODEL)
    assert (snap["leases"], snap["used"]["total"]) == (1, 1)


async def test_a_full_quota_with_no_wait_budget_is_429_and_holds_nothing(ctx: GatewayContext) -> None:
    for _ in range(2):
        assert (await admit(ctx, request_flow())).response is None
    flow = await admit(ctx, request_flow(headers={"x-kvgate-max-wait-ms": "0"}))
    status, _ = error_of(flow)
    assert status == 429 and flow.response is not None and int(flow.response.headers["retry-after"]) >= 1
    state = state_of(flow)
    assert state is not None and state.lease is None
    assert (await ctx.pool.snapshot(MODEL))["used"]["total"] == 2  # only the two admitted ones
    assert ctx.pool.held() == 2


async def test_a_refused_request_never_reaches_admission(ctx: GatewayContext) -> None:
    flow = await admit(ctx, request_flow(body=b"{nope"))
    assert error_of(flow) == (400, "invalid_json")
    assert ctx.pool.held() == 0 and (await ctx.pool.snapshot(MODEL))["used"]["total"] == 0
