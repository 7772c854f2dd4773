"""plugin/dispatch.py, built with only what it reads (whether to ask for usage, the metrics): the upstream
rewrite, x-request-id and the usage request."""

from __future__ import annotations

import json

import pytest
from mitmproxy.test import tutils

from plugin.auth import Caller
from plugin.config import LimitsSection, RoutingSection
from plugin.dispatch import Dispatch, Target, point_at, sanitize_upstream_headers
from plugin.endpoints import ENDPOINTS
from plugin.flow import MEMO_LIMIT, STATE, FlowState, Upstream
from plugin.metrics import GatewayMetrics
from plugin.parse import parse_completion
from plugin.prefix_memo import hash_prompt
from plugin.routing import Router
from policy.types import Band
from store.registry import WorkerRecord
from tests.unit.plugin.test_addon import MODEL, request_flow

WORKER = WorkerRecord(id="w0", model=MODEL, url="http://10.0.0.7:8123", lease_expiry_ms=2**62)


def admitted(body: dict[str, object]) -> tuple[object, FlowState]:
    flow = request_flow(body)
    parsed = parse_completion(ENDPOINTS["chat"], flow.request.content or b"", LimitsSection())
    prompt = hash_prompt(parsed.body, MODEL, 256)
    state = FlowState(request_id="rid-1", received_at=0.0, parsed=parsed, prompt=prompt,
                      caller=Caller(tenant="t", band=Band.NORMAL, max_wait_s=0.0))  # fmt: skip
    state.route = Router(RoutingSection()).choose(
        request_id="rid-1", model=MODEL, prompt=prompt, max_tokens=4, band=Band.NORMAL, tenant="t",
        workers=[WORKER],
    )  # fmt: skip
    flow.metadata[STATE] = state
    return flow, state


@pytest.mark.parametrize("collect_usage", [True, False])
async def test_an_admitted_stream_goes_to_its_worker_with_usage_asked_for(collect_usage: bool) -> None:
    metrics = GatewayMetrics()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    flow, state = admitted(body)
    await Dispatch(collect_usage=collect_usage, metrics=metrics).request(flow)  # type: ignore[arg-type]
    request = flow.request  # type: ignore[attr-defined]
    assert (request.scheme, request.host, request.port) == ("http", "10.0.0.7", 8123)
    assert request.headers["x-request-id"] == "rid-1"
    sent = json.loads(request.content)
    assert ("stream_options" in sent) is collect_usage and state.usage_requested is collect_usage
    assert metrics.routed.get(MODEL, "w0", "miss", "default") == 1


async def test_worker_addresses_are_remembered_up_to_a_bound_and_still_rewritten_after_it() -> None:
    """A fleet whose workers come and go (new addresses) must not grow the address memo forever."""
    dispatch = Dispatch(collect_usage=False, metrics=GatewayMetrics())
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for i in range(MEMO_LIMIT + 10):
        flow, state = admitted(body)
        assert state.route is not None
        state.route.upstream = Upstream("http", f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8000)
        await dispatch.request(flow)  # type: ignore[arg-type]
        assert flow.request.host == state.route.upstream.host  # type: ignore[attr-defined]
    assert len(dispatch._targets) <= MEMO_LIMIT
    router = Router(RoutingSection())
    for i in range(MEMO_LIMIT + 10):
        assert router.upstream(f"http://10.1.{i // 256}.{i % 256}:8000").host == f"10.1.{i // 256}.{i % 256}"
    assert len(router._upstreams) <= MEMO_LIMIT


async def test_a_request_without_a_route_is_503_not_forwarded() -> None:
    flow, state = admitted({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    state.route = None
    await Dispatch(collect_usage=True, metrics=GatewayMetrics()).request(flow)  # type: ignore[arg-type]
    assert flow.response is not None and flow.response.status_code == 503  # type: ignore[attr-defined]


async def test_client_credentials_and_hop_headers_never_reach_the_worker() -> None:
    flow, _ = admitted({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    headers = flow.request.headers  # type: ignore[attr-defined]
    for name, value in (("Authorization", "Bearer tenant"), ("X-Forwarded-For", "1.2.3.4"),
                        ("x-kvgate-worker", "spoof"), ("Connection", "x-hop"), ("x-hop", "1"),
                        ("x-request-id", "client-raw"), ("x-keep", "yes")):  # fmt: skip
        headers.add(name, value)
    keys = {"w0": "worker-key"}
    await Dispatch(
        collect_usage=False, metrics=GatewayMetrics(), upstream_key=lambda w: keys.get(w, "")
    ).request(
        flow  # type: ignore[arg-type]
    )
    sent = flow.request.headers  # type: ignore[attr-defined]
    assert sent["authorization"] == "Bearer worker-key" and sent["x-keep"] == "yes"
    assert sent.get_all("x-request-id") == ["rid-1"]
    for name in ("x-forwarded-for", "x-kvgate-worker", "connection", "x-hop"):
        assert name not in sent


async def test_prefix_switches_count_a_prefix_moving_to_another_worker_and_nothing_else() -> None:
    """kvgate_prefix_switches_total, on a real Router: +1 exactly when a prefix's request goes to
    another worker than the prefix's previous request went to (not on its first request, not when it
    stays, not for an unrelated prefix)."""
    metrics, router = GatewayMetrics(), Router(RoutingSection())
    w1 = WorkerRecord(id="w1", model=MODEL, url="http://10.0.0.8:8123", lease_expiry_ms=2**62)
    dispatch = Dispatch(collect_usage=False, metrics=metrics)

    async def send(text: str, workers: list[WorkerRecord]) -> str:
        flow = request_flow({"model": MODEL, "messages": [{"role": "user", "content": text}]})
        parsed = parse_completion(ENDPOINTS["chat"], flow.request.content or b"", LimitsSection())
        prompt = hash_prompt(parsed.body, MODEL, 256)
        state = FlowState(request_id="r", received_at=0.0, parsed=parsed, prompt=prompt,
                          caller=Caller(tenant="t", band=Band.NORMAL, max_wait_s=0.0))  # fmt: skip
        state.route = router.route(
            request_id="r", model=MODEL, prompt=prompt, max_tokens=4, band=Band.NORMAL, tenant="t",
            workers=workers,
        )  # fmt: skip
        assert state.route is not None
        flow.metadata[STATE] = state
        await dispatch.request(flow)  # type: ignore[arg-type]
        router.finished(state.route)
        return state.route.worker.id

    def switches() -> float:
        return metrics.prefix_switches.get(MODEL, "default")

    shared, other = "a shared system prompt " * 100, "another conversation entirely " * 100
    assert await send(shared, [WORKER]) == "w0" and switches() == 0  # first request: nowhere before
    assert await send(shared, [WORKER]) == "w0" and switches() == 0  # stays
    assert await send(shared, [w1]) == "w1" and switches() == 1  # moved w0 -> w1
    assert await send(shared, [w1]) == "w1" and switches() == 1  # stays on w1 now
    assert await send(other, [WORKER]) == "w0" and switches() == 1  # another prefix, first request
    assert await send(shared, [WORKER]) == "w0" and switches() == 2  # moved back w1 -> w0


def _old_point_at(request: object, up: Upstream, request_id: str, key: str) -> None:
    """The rewrite as it was: mitmproxy's setters, then the header filter."""
    request.scheme, request.data.host, request.port = up.scheme, up.host, up.port  # type: ignore[attr-defined]
    sanitize_upstream_headers(request.headers, request_id, key)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"Host", b"gateway")],
        [(b"content-type", b"application/json"), (b"HOST", b"gateway:8080"), (b"x-keep", b"1")],
        [(b"Host", b"a"), (b"x-keep", b"1"), (b"host", b"b"), (b"Host", b"c")],  # duplicates
        [(b"Connection", b"host, x-hop"), (b"Host", b"a"), (b"x-hop", b"1")],  # Connection names Host
        [(b"x-kvgate-worker", b"spoof"), (b"Authorization", b"Bearer t"), (b"x-request-id", b"c")],
    ],
)
@pytest.mark.parametrize("authority", [b"", b"gateway:8080"])
@pytest.mark.parametrize(
    "up",
    [Upstream("http", "10.0.0.7", 8123), Upstream("http", "w1", 80), Upstream("https", "w2.example", 443)],
)
@pytest.mark.parametrize("key", ["", "worker-key"])
def test_point_at_leaves_the_request_as_the_setters_and_the_filter_did(
    headers: list[tuple[bytes, bytes]], authority: bytes, up: Upstream, key: str
) -> None:
    """The one-pass rewrite of the upstream (plugin/dispatch.py `point_at`) against mitmproxy's own
    scheme/host/port setters followed by `sanitize_upstream_headers`: the same request data, fields
    and their order included."""
    requests = []
    for _ in range(2):
        request = tutils.treq(authority=authority)
        request.headers.fields = tuple(headers)
        requests.append(request)
    new, old = requests
    point_at(new, Target.of(up), "rid-1", key)
    _old_point_at(old, up, "rid-1", key)
    assert new.data == old.data
    assert new.headers.fields == old.headers.fields
