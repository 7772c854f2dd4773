"""Intake alone (plugin/intake.py): what it sets on the flow, and what it refuses before admission.

Built from a `GatewayContext` of real services over the embedded Redis (tests/unit/plugin/parts.py);
no addon, no admission: a request intake accepts has no response and no lease yet."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from plugin.context import GatewayContext
from plugin.flow import state_of
from plugin.intake import Intake
from plugin.mirror import wall_ms
from plugin.prefix_memo import hash_prompt
from store import registry
from store.registry import WorkerRecord
from tests.unit.plugin.parts import gateway_context
from tests.unit.plugin.test_addon import MODEL, error_of, request_flow

CONFIG = {
    "auth": {"enabled": True},
    "tenants": {"gold": {"api_keys": ["k-gold"], "max_band": "high"}, "batch": {"api_keys": ["k-batch"]}},
    "limits": {"max_messages": 4},
}
GOLD = {"authorization": "Bearer k-gold"}


@pytest.fixture
async def ctx(redis: aioredis.Redis) -> AsyncIterator[GatewayContext]:
    now = wall_ms()
    await registry.register(
        redis, WorkerRecord(id="w0", model=MODEL, url="http://10.1.2.3:8000"), 60_000, now
    )
    await registry.register(
        redis, WorkerRecord(id="d0", model="drained", url="http://10.1.2.4:8000"), 60_000, now
    )
    await registry.set_draining(redis, "drained", "d0", True)
    async with gateway_context(redis, CONFIG) as context:
        assert context.workers.mirror is not None
        await context.workers.mirror.refresh()
        yield context


async def test_an_accepted_request_has_its_caller_body_and_prefix_hashes(ctx: GatewayContext) -> None:
    flow = request_flow(headers={**GOLD, "x-kvgate-priority": "high", "x-request-id": "abc-1"})
    await Intake(ctx).request(flow)
    state = state_of(flow)
    assert flow.response is None and state is not None
    assert state.caller is not None and (state.caller.tenant, state.caller.band.name) == ("gold", "HIGH")
    assert state.parsed is not None and state.parsed.model == MODEL
    assert state.prompt == hash_prompt(state.parsed.body, MODEL, ctx.config.routing.chunk_chars)
    assert state.client_request_id == "abc-1" and state.request_id.startswith("abc-1.")
    assert state.lease is None and ctx.pool.held() == 0  # admission is the next part's


async def test_a_reused_request_id_gets_a_lease_id_of_its_own(ctx: GatewayContext) -> None:
    ids = set()
    for _ in range(3):
        flow = request_flow(headers={**GOLD, "x-request-id": "same"})
        await Intake(ctx).request(flow)
        state = state_of(flow)
        assert state is not None
        ids.add(state.request_id)
    assert len(ids) == 3


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        pytest.param({"headers": {}}, 401, "missing_api_key", id="no key"),
        pytest.param({"headers": {"authorization": "Bearer nope"}}, 401, "invalid_api_key", id="unknown key"),
        pytest.param({"headers": {**GOLD, "x-request-id": "a b"}}, 400, "invalid_request_id", id="bad id"),
        pytest.param({"body": b"[1]"}, 400, "invalid_body", id="not an object"),
        pytest.param(
            {"body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 5}},
            400, "too_many_messages", id="over max_messages",
        ),
        pytest.param(
            {"body": {"model": MODEL, "messages": [{"role": "user", "name": 3, "content": "x"}]}},
            400, "invalid_request", id="a name that is not a string",
        ),
        pytest.param(
            {"body": {"model": "nobody", "messages": [{"role": "user", "content": "x"}]}},
            404, "model_not_found", id="unknown model",
        ),
        pytest.param(
            {"body": {"model": "drained", "messages": [{"role": "user", "content": "x"}]}},
            503, "no_healthy_worker", id="only draining workers",
        ),
    ],
)  # fmt: skip
async def test_refusals(ctx: GatewayContext, kwargs: dict[str, object], status: int, code: str) -> None:
    kwargs.setdefault("headers", GOLD)
    flow = request_flow(**kwargs)  # type: ignore[arg-type]
    await Intake(ctx).request(flow)
    assert error_of(flow) == (status, code)
    state = state_of(flow)
    assert state is not None and state.prompt is None and ctx.pool.held() == 0


async def test_draining_refuses_with_retry_after(ctx: GatewayContext) -> None:
    ctx.process.draining = True
    flow = request_flow(headers=GOLD)
    await Intake(ctx).request(flow)
    assert error_of(flow) == (503, "draining")
    assert flow.response is not None and flow.response.headers["retry-after"] == "1"


async def test_local_endpoints_are_answered_without_a_flow_state(ctx: GatewayContext) -> None:
    flow = request_flow(path="/v1/models", method="GET", body=b"")
    await Intake(ctx).request(flow)
    assert flow.response is not None and flow.response.status_code == 200
    assert MODEL.encode() in (flow.response.content or b"")
    assert state_of(flow) is None
