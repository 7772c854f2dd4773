"""Release alone (plugin/release.py), after Intake and Admission: response headers, and the lease
given back exactly once whichever end hook fires first, as Redis sees it. No addon
(tests/unit/plugin/parts.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from mitmproxy.test import tflow, tutils

from plugin.admit import Admission
from plugin.context import GatewayContext
from plugin.flow import state_of
from plugin.intake import Intake
from plugin.mirror import wall_ms
from plugin.quotas import write_quota
from plugin.release import Release
from policy.admission import Quota
from store import registry
from store.registry import WorkerRecord
from tests.polling import until
from tests.unit.plugin.parts import gateway_context
from tests.unit.plugin.test_addon import MODEL, request_flow


@pytest.fixture
async def ctx(redis: aioredis.Redis) -> AsyncIterator[GatewayContext]:
    await registry.register(
        redis, WorkerRecord(id="w0", model=MODEL, url="http://10.1.2.3:8000"), 60_000, wall_ms()
    )
    await write_quota(redis, MODEL, Quota(total=4, count_seats=False))
    config = {"models": {MODEL: {"total": 4}}, "decision_log": {"redis_stream": False}}
    async with gateway_context(redis, config) as context:
        assert context.workers.mirror is not None
        await context.workers.mirror.refresh()
        yield context


async def released_in_redis(ctx: GatewayContext) -> None:
    async def released() -> bool:
        snap = await ctx.pool.snapshot(MODEL)
        return bool(snap["leases"] == 0 and snap["used"]["total"] == 0)

    await until(released, "the release to reach Redis")


@pytest.mark.parametrize("first", ["response", "error"])
async def test_the_lease_is_released_once_whichever_end_hook_comes_first(
    ctx: GatewayContext, first: str
) -> None:
    flow = request_flow(headers={"x-request-id": "r-1"})
    await Intake(ctx).request(flow)
    await Admission(ctx).request(flow)
    state = state_of(flow)
    assert state is not None and state.lease is not None
    assert (await ctx.pool.snapshot(MODEL))["used"]["total"] == 1
    release = Release(ctx)
    flow.response = tutils.tresp(content=b'{"usage": {"prompt_tokens": 5, "completion_tokens": 3}}')
    release.responseheaders(flow)
    assert flow.response.headers["x-kvgate-worker"] == "w0"
    assert flow.response.headers["x-kvgate-request-id"] == state.request_id
    flow.error = tflow.terr("late error")
    hooks = [release.response, release.error]
    for hook in hooks if first == "response" else hooks[::-1]:
        hook(flow)
    assert ctx.releaser.released == 1 and state.lease is None
    await released_in_redis(ctx)
    assert ctx.pool.held() == 0
