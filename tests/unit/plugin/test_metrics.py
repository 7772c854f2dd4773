"""The Prometheus text the gateway exports parses line by line and counts what was observed."""

from __future__ import annotations

from plugin.metrics import GatewayMetrics


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_render() -> None:
    m = GatewayMetrics()
    m.requests.inc("llama", "high", "200")
    m.requests.inc("llama", "high", "200")
    m.ttft.observe(0.03, "llama")
    m.ttft.observe(7.0, "llama")
    m.routed.inc("llama", 'w"1', "prefix")
    text = m.render()
    got = samples(text)
    assert got['kvgate_requests_total{model="llama",band="high",status="200"}'] == 2
    assert got['kvgate_ttft_seconds_bucket{model="llama",le="0.05"}'] == 1
    assert got['kvgate_ttft_seconds_bucket{model="llama",le="+Inf"}'] == 2
    assert got['kvgate_ttft_seconds_count{model="llama"}'] == 2
    assert got['kvgate_routing_decisions_total{model="llama",worker="w\\"1",kind="prefix"}'] == 1
    assert "# TYPE kvgate_ttft_seconds histogram" in text


# The exported contract (dashboards, alerts, docs/GATEWAY.md): names, kinds and label names, as on
# main before the layout refactor. A change here is a breaking change for every scraper.
EXPORTED = [
    ("kvgate_admission_rejected_total", "counter", ("model", "reason")),
    ("kvgate_admission_wait_seconds", "histogram", ("model", "band")),
    ("kvgate_cached_tokens_total", "counter", ("model",)),
    ("kvgate_connect_retries_total", "counter", ("model", "worker")),  # issue 10 (added)
    ("kvgate_draining", "gauge", ()),
    ("kvgate_expected_queue_wait_seconds", "gauge", ("model",)),
    ("kvgate_global_queue_length", "gauge", ("model", "band")),
    ("kvgate_inflight_requests", "gauge", ("model",)),
    ("kvgate_local_requests_total", "counter", ("path",)),
    ("kvgate_output_tokens_total", "counter", ("model",)),
    ("kvgate_prefix_fallbacks_total", "counter", ("model", "reason")),
    ("kvgate_priority_clamped_total", "counter", ("tenant",)),  # issue 10 (added)
    ("kvgate_prompt_tokens_total", "counter", ("model",)),
    ("kvgate_queue_length", "gauge", ("model",)),
    ("kvgate_requests_total", "counter", ("model", "band", "status")),
    ("kvgate_routing_decisions_total", "counter", ("model", "worker", "kind")),
    ("kvgate_seats_used", "gauge", ("model",)),
    ("kvgate_session_routes_total", "counter", ("model", "outcome")),  # issue 9 (added)
    ("kvgate_sessions_closed_total", "counter", ("model",)),  # issue 9 (added)
    ("kvgate_slot_drift", "gauge", ("model",)),
    ("kvgate_tokenize_seconds", "histogram", ("model",)),
    ("kvgate_tokenize_total", "counter", ("model", "source")),
    ("kvgate_ttft_seconds", "histogram", ("model",)),
    ("kvgate_worker_full_total", "counter", ("model", "worker")),
    ("kvgate_workers", "gauge", ("model", "state")),
]


def test_exported_metric_names_kinds_and_labels_are_unchanged() -> None:
    m = GatewayMetrics()
    assert sorted((x.name, x.kind, tuple(x.label_names)) for x in m.all()) == EXPORTED
    text = m.render()
    for name, kind, _ in EXPORTED:
        assert f"# TYPE {name} {kind}" in text
