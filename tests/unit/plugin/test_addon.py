"""The KvGate addon's hooks in `taddons` with a real Redis: options, refusals, rerouting, release.

No sockets to workers are opened: hooks are called directly (MITMPROXY.md §6), the worker registry
is written with store.registry, and the slot pool is the real one on the test Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from mitmproxy import exceptions, http
from mitmproxy.test import taddons, tflow, tutils

from plugin.addon import KvGate
from plugin.flow import state_of
from plugin.mirror import wall_ms
from plugin.quotas import write_quota
from plugin.release import ABORT_GRACE_S
from policy.admission import Quota
from store import registry
from store.registry import WorkerRecord
from tests.polling import until
from tests.prom import metric

MODEL = "m"


def request_flow(
    body: bytes | dict[str, object] | None = None,
    *,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> http.HTTPFlow:
    if body is None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    flow = tflow.tflow(
        req=tutils.treq(
            method=method.encode(),
            path=path.encode(),
            content=content,
            headers=http.Headers(host="gateway", content_type="application/json", **(headers or {})),
        )
    )
    flow.client_conn.timestamp_end = None  # the client is still connected
    return flow


def error_of(flow: http.HTTPFlow) -> tuple[int, str]:
    assert flow.response is not None
    body = json.loads(flow.response.content or b"")
    return flow.response.status_code, body["error"]["code"]


async def run_request(gate: KvGate, flow: http.HTTPFlow) -> None:
    await gate.request(flow)


@pytest.fixture
async def gate(redis: aioredis.Redis, redis_url: str, tmp_path: Path) -> AsyncIterator[KvGate]:
    config = tmp_path / "kvgate.toml"
    config.write_text(
        '[auth]\nenabled = false\n[tenants.gold]\napi_keys = ["k-gold"]\nmax_band = "high"\n'
        '[tenants.batch]\napi_keys = ["k-batch"]\nmax_band = "low"\n'
        "[decision_log]\nredis_stream = false\n"
    )
    now = wall_ms()
    await registry.register(
        redis, WorkerRecord(id="w0", model=MODEL, url="http://10.1.2.3:8000"), 60_000, now
    )
    await write_quota(redis, MODEL, Quota(total=2, count_seats=False))
    async with running_gate(config, redis_url) as addon:
        yield addon


@contextlib.asynccontextmanager
async def running_gate(config: Path, redis_url: str) -> AsyncIterator[KvGate]:
    """A KvGate configured from `config` on the test Redis, running until the block ends."""
    addon = KvGate()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, kvgate_config=str(config), kvgate_redis_url=redis_url, kvgate_gateway_id="t")
        await addon.running()
        try:
            yield addon
        finally:
            await addon.done()


def test_invalid_config_is_an_options_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[limits]\nmax_messages = 0\n")
    addon = KvGate()
    with (
        taddons.context(addon) as tctx,
        pytest.raises(exceptions.OptionsError, match=r"limits\.max_messages"),
    ):
        tctx.configure(addon, kvgate_config=str(bad))


async def until_released_in_redis(gate: KvGate) -> None:
    """The lease reached Redis's release script: no lease and no seat left for the model there."""
    assert gate.pool is not None

    async def released() -> bool:
        assert gate.pool is not None
        snap = await gate.pool.snapshot(MODEL)
        return snap["leases"] == 0 and snap["used"]["total"] == 0

    await until(released, "the release to reach Redis")
    assert gate.pool.held() == 0


async def test_admitted_request_is_rerouted_and_released_once(gate: KvGate) -> None:
    flow = request_flow(headers={"x-kvgate-priority": "high", "authorization": "Bearer k-gold"})
    await run_request(gate, flow)
    assert flow.response is None
    assert (flow.request.host, flow.request.port, flow.request.scheme) == ("10.1.2.3", 8000, "http")
    state = state_of(flow)
    assert state is not None and state.lease is not None and state.route is not None
    assert flow.request.headers["x-request-id"] == state.request_id
    assert state.caller is not None and state.caller.tenant == "gold" and state.caller.band.name == "HIGH"
    assert gate.pool.held() == 1
    flow.response = tutils.tresp(content=b'{"usage": {"completion_tokens": 3}}')
    gate.responseheaders(flow)
    assert flow.response.headers["x-kvgate-worker"] == "w0"
    gate.response(flow)
    flow.error = tflow.terr("late error")
    gate.error(flow)
    assert gate.releases == 1  # response and error both fired; released exactly once
    await until_released_in_redis(gate)


async def test_the_decision_record_splits_the_gateways_time(
    redis: aioredis.Redis, redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "decisions.jsonl"
    config = tmp_path / "kvgate.toml"
    config.write_text(f'[auth]\nenabled = false\n[decision_log]\nredis_stream = false\nfile = "{log}"\n')
    await registry.register(
        redis, WorkerRecord(id="w0", model=MODEL, url="http://10.1.2.3:8000"), 60_000, wall_ms()
    )
    async with running_gate(config, redis_url) as gate:
        flow = request_flow()
        await run_request(gate, flow)
        assert flow.response is None
        await asyncio.sleep(0.02)  # the worker's headers come 20 ms after the request went upstream
        flow.response = tutils.tresp(content=b'{"usage": {"completion_tokens": 3}}')
        flow.response.timestamp_start = time.time()
        gate.responseheaders(flow)
        gate.response(flow)
        await until(lambda: log.exists() and bool(log.read_text()), "the decision record")
    record = json.loads(log.read_text().splitlines()[0])
    assert set(record["stage_us"]) == {"parse", "hash", "admit", "route"}  # approximate: no tokenize
    assert 0 < sum(record["stage_us"].values()) / 1000 <= record["gateway_ms"]
    assert record["gateway_ms"] + 20 <= record["headers_ms"] <= record["latency_ms"]


async def test_client_gone_mid_stream_releases(gate: KvGate) -> None:
    flow = request_flow()
    await run_request(gate, flow)
    assert state_of(flow) is not None and state_of(flow).lease is not None  # type: ignore[union-attr]
    flow.error = tflow.terr("Client disconnected.")
    gate.error(flow)
    assert gate.releases == 0  # held while its worker notices the closed connection
    await asyncio.sleep(ABORT_GRACE_S + 0.1)
    assert gate.releases == 1
    await until_released_in_redis(gate)


async def test_band_is_clamped_for_the_tenant(gate: KvGate) -> None:
    flow = request_flow(headers={"x-kvgate-priority": "high", "authorization": "Bearer k-batch"})
    await run_request(gate, flow)
    state = state_of(flow)
    assert state is not None and state.caller is not None and state.caller.band.name == "LOW"


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        pytest.param({"body": b"{nope"}, 400, "invalid_json", id="malformed JSON"),
        pytest.param({"body": {"model": MODEL, "messages": "hi"}}, 400, "missing_messages", id="wrong type"),
        pytest.param(
            {"body": {"model": "other", "messages": [{"role": "user", "content": "x"}]}},
            404,
            "model_not_found",
            id="unknown model",
        ),
        pytest.param({"path": "/v1/embeddings"}, 404, "not_found", id="unknown path"),
        pytest.param({"path": "/v1/chat/completions", "method": "GET"}, 405, "method_not_allowed", id="GET"),
        pytest.param(
            {"headers": {"x-kvgate-priority": "urgent"}}, 400, "invalid_priority", id="bad priority"
        ),
        pytest.param(
            {"headers": {"x-kvgate-max-wait-ms": "soon"}}, 400, "invalid_wait_budget", id="bad wait"
        ),
    ],
)
async def test_refusals_are_json_and_take_no_slot(
    gate: KvGate, kwargs: dict[str, object], status: int, code: str
) -> None:
    flow = request_flow(**kwargs)  # type: ignore[arg-type]
    await run_request(gate, flow)
    assert error_of(flow) == (status, code)
    assert flow.request.host != "10.1.2.3"  # never rerouted to a worker
    assert gate.pool.held() == 0


async def test_full_quota_without_waiting_is_429(gate: KvGate) -> None:
    held = [request_flow() for _ in range(2)]
    for flow in held:
        await run_request(gate, flow)
    assert gate.pool.held() == 2
    flow = request_flow(headers={"x-kvgate-max-wait-ms": "0"})
    await run_request(gate, flow)
    assert flow.response is not None and flow.response.status_code == 429
    assert int(flow.response.headers["retry-after"]) >= 1
    assert "estimated_wait_s" in json.loads(flow.response.content or b"")["error"]


async def test_local_endpoints(gate: KvGate) -> None:
    models = request_flow(path="/v1/models", method="GET", body=b"")
    await run_request(gate, models)
    assert models.response is not None
    assert [m["id"] for m in json.loads(models.response.content or b"")["data"]] == [MODEL]
    health = request_flow(path="/readyz", method="GET", body=b"")
    await run_request(gate, health)
    assert health.response is not None and health.response.status_code == 200
    for path in ("/healthz", "/metrics"):  # only on the metrics port (plugin/metrics_server.py)
        flow = request_flow(path=path, method="GET", body=b"")
        await run_request(gate, flow)
        assert error_of(flow) == (404, "not_found")
        assert b"metrics port" in (flow.response.content or b"")  # type: ignore[union-attr]
    assert gate.local is not None
    await gate.local.refresh()  # what the metrics port's refresher does every second
    text = gate.metrics.render()
    assert "kvgate_requests_total" in text
    assert metric(text, "kvgate_global_queue_length", model="m", band="high") == 0


async def test_draining_gateway_refuses_new_requests(gate: KvGate) -> None:
    gate.process.draining = True
    flow = request_flow()
    await run_request(gate, flow)
    assert error_of(flow) == (503, "draining")
    health = request_flow(path="/readyz", method="GET", body=b"")
    await run_request(gate, health)
    assert health.response is not None and health.response.status_code == 503


async def test_disconnect_while_queued_leaves_the_queue(gate: KvGate) -> None:
    import asyncio

    held = [request_flow() for _ in range(2)]
    for flow in held:
        await run_request(gate, flow)
    waiter = request_flow(headers={"x-kvgate-max-wait-ms": "20000"})
    task = asyncio.ensure_future(run_request(gate, waiter))
    for _ in range(500):
        if gate.process.waiters:
            break
        await asyncio.sleep(0.01)
    assert gate.process.waiters, "the third request should be queued"
    gate.client_disconnected(waiter.client_conn)
    await asyncio.wait_for(task, 5)
    assert waiter.error is not None and waiter.response is None  # killed: never reaches a worker
    assert state_of(waiter) is not None and state_of(waiter).lease is None  # type: ignore[union-attr]
    # a slot freed afterwards is not lost to the departed waiter
    held[0].error = tflow.terr("Client disconnected.")
    gate.error(held[0])
    nxt = request_flow(headers={"x-kvgate-max-wait-ms": "5000"})
    await run_request(gate, nxt)
    assert nxt.response is None and state_of(nxt).lease is not None  # type: ignore[union-attr]


async def test_low_priority_is_shed_under_sustained_pressure(gate: KvGate) -> None:
    import asyncio
    import time

    held = [request_flow() for _ in range(2)]
    for flow in held:
        await run_request(gate, flow)
    high = request_flow(headers={"x-kvgate-priority": "high", "authorization": "Bearer k-gold"})
    high.request.headers["x-kvgate-max-wait-ms"] = "20000"
    task = asyncio.ensure_future(run_request(gate, high))
    for _ in range(500):
        if gate.process.waiters:
            break
        await asyncio.sleep(0.01)
    assert gate.queue_signal is not None
    signal = gate.queue_signal
    signal.clock = lambda: time.monotonic() - 60  # the high band has been waiting for a minute
    await signal.refresh_once()

    low = request_flow(headers={"authorization": "Bearer k-batch", "x-kvgate-max-wait-ms": "20000"})
    await run_request(gate, low)
    assert error_of(low) == (429, "shed")
    assert low.response is not None and low.response.headers["x-kvgate-shed"] == "low-priority"
    assert int(low.response.headers["retry-after"]) >= 1
    normal = request_flow(headers={"x-kvgate-max-wait-ms": "0"})
    await run_request(gate, normal)
    assert error_of(normal) == (429, "quota")  # only the low band is shed
    assert gate.pool.held() == 2 and len(gate.process.waiters) == 1  # the shed request took nothing

    for flow in held:  # the burst ends: the high waiter runs, its queue empties
        flow.error = tflow.terr("Client disconnected.")
        gate.error(flow)
    await asyncio.wait_for(task, 5)
    signal.clock = time.monotonic
    await signal.refresh_once()
    low = request_flow(headers={"authorization": "Bearer k-batch", "x-kvgate-max-wait-ms": "0"})
    await run_request(gate, low)
    assert low.response is None and state_of(low).lease is not None  # type: ignore[union-attr]


async def test_ttft_slo_refuses_at_the_door_and_bounds_the_wait(gate: KvGate) -> None:
    long_prompt = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me " * 20_000}],
        "max_tokens": 4,
    }
    hopeless = request_flow(long_prompt, headers={"x-kvgate-ttft-slo-ms": "1"})
    await run_request(gate, hopeless)
    assert error_of(hopeless) == (429, "slo_unreachable")
    assert gate.pool.held() == 0 and not gate.process.waiters  # refused before it took anything

    held = [request_flow() for _ in range(2)]  # the quota (2) is full
    for flow in held:
        await run_request(gate, flow)
    waiter = request_flow(headers={"x-kvgate-ttft-slo-ms": "300", "x-kvgate-max-wait-ms": "20000"})
    await run_request(gate, waiter)  # may wait only what its SLO leaves, not its 20 s budget
    assert error_of(waiter) == (429, "wait_budget")

    for flow in held:
        flow.error = tflow.terr("Client disconnected.")
        gate.error(flow)
    feasible = request_flow(headers={"x-kvgate-ttft-slo-ms": "60000"})
    await run_request(gate, feasible)
    assert feasible.response is None and state_of(feasible).lease is not None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("max_queue_ms", "signal"),
    [(200, "lateness"), (200, "dispatched"), (0, "lateness"), (0, "dispatched")],
)
async def test_engine_queue_guard_refuses_below_high_at_the_door(
    redis: aioredis.Redis, redis_url: str, tmp_path: Path, max_queue_ms: int, signal: str
) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text(
        '[auth]\nenabled = false\n[tenants.gold]\napi_keys = ["k-gold"]\nmax_band = "high"\n'
        f'[admission]\nmax_queue_ms = {max_queue_ms}\nqueue_signal = "{signal}"\n'
        "[decision_log]\nredis_stream = false\n"
    )
    await registry.register(
        redis, WorkerRecord(id="w0", model=MODEL, url="http://10.1.2.3:8000"), 60_000, wall_ms()
    )
    await write_quota(redis, MODEL, Quota(total=10, count_seats=False))
    long_prompt = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me " * 20_000}],
        "max_tokens": 4,
    }
    async with running_gate(config, redis_url) as gate:
        first = request_flow(long_prompt)  # nothing queued on w0 yet: admitted
        await run_request(gate, first)
        assert first.response is None and state_of(first).lease is not None  # type: ignore[union-attr]
        behind = request_flow(long_prompt)  # w0 now has the first prompt's prefill ahead of it
        await run_request(gate, behind)
        high = request_flow(
            long_prompt, headers={"x-kvgate-priority": "high", "authorization": "Bearer k-gold"}
        )
        await run_request(gate, high)
        assert high.response is None  # the high band is never refused by the guard
        if max_queue_ms == 0:  # off: queued behind it on the engine, as without the guard
            assert behind.response is None
            return
        assert error_of(behind) == (429, "queue_too_deep")
        assert behind.response is not None and int(behind.response.headers["retry-after"]) >= 1
        assert gate.pool is not None and gate.pool.held() == 2  # the refused request took nothing


def _guard_config(path: Path, max_queue_ms: int, signal: str) -> Path:
    path.write_text(
        f'[auth]\nenabled = false\n[admission]\nmax_queue_ms = {max_queue_ms}\nqueue_signal = "{signal}"\n'
        "[decision_log]\nredis_stream = false\n"
    )
    return path


def _chat(text: str) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


@pytest.mark.parametrize("signal", ["dispatched", "dispatched_ttft"])
async def test_dispatched_ttft_guard_refuses_a_long_miss_before_a_short_request_at_one_queue(
    redis: aioredis.Redis, redis_url: str, tmp_path: Path, signal: str
) -> None:
    await registry.register(
        redis, WorkerRecord(id="w0", model=MODEL, url="http://10.1.2.3:8000"), 60_000, wall_ms()
    )
    await write_quota(redis, MODEL, Quota(total=10, count_seats=False))
    # the long prompt's own prefill on an idle w0, from a gateway that only measures it (its own ledger)
    async with running_gate(_guard_config(tmp_path / "probe.toml", 0, signal), redis_url) as gate:
        probe = request_flow(_chat("show me " * 20_000))
        await run_request(gate, probe)
        route = state_of(probe).route  # type: ignore[union-attr]
        assert route is not None
        own_s = route.decision.scores["w0"]["predicted-ttft"]
    # one long prompt queued: a request behind it waits ~own_s, a long miss behind it needs ~2 x own_s
    budget_ms = int(own_s * 1500)
    async with running_gate(_guard_config(tmp_path / "guard.toml", budget_ms, signal), redis_url) as gate:
        first = request_flow(_chat("tell me " * 20_000))
        await run_request(gate, first)
        assert first.response is None
        short = request_flow(_chat("hello"))
        await run_request(gate, short)
        assert short.response is None  # its wait and its own prefill are within the budget
        long_miss = request_flow(_chat("give me " * 20_000))
        await run_request(gate, long_miss)
        if signal == "dispatched":  # the same queue ahead as the short request: admitted too
            assert long_miss.response is None
        else:  # its own uncached prefill takes it past the budget
            assert error_of(long_miss) == (429, "queue_too_deep")


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
async def test_bad_ttft_slo_is_400(gate: KvGate, value: str) -> None:
    flow = request_flow(headers={"x-kvgate-ttft-slo-ms": value})
    await run_request(gate, flow)
    assert error_of(flow) == (400, "invalid_ttft_slo")
