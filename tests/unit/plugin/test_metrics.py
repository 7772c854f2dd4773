"""The Prometheus text the gateway exports parses line by line and counts what was observed."""

from __future__ import annotations

from plugin.metrics import GatewayMetrics, outcome_of, reason_class
from tests.prom import samples


def test_render() -> None:
    m = GatewayMetrics()
    m.requests.inc("llama", "high", "200")
    m.requests.inc("llama", "high", "200")
    m.ttft.observe(0.03, "llama", "default")
    m.ttft.observe(7.0, "llama", "default")
    m.routed.inc("llama", 'w"1', "prefix")
    text = m.render()
    got = samples(text)

    def at(name: str, **labels: str) -> float:
        return got[name, frozenset(labels.items())]

    assert at("kvgate_requests_total", model="llama", band="high", status="200") == 2
    assert at("kvgate_ttft_seconds_bucket", model="llama", arm="default", le="0.05") == 1
    assert at("kvgate_ttft_seconds_bucket", model="llama", arm="default", le="+Inf") == 2
    assert at("kvgate_ttft_seconds_count", model="llama", arm="default") == 2
    assert at("kvgate_routing_decisions_total", model="llama", worker='w"1', kind="prefix") == 1
    assert m.requests.get("llama", "high", "200") == 2 and m.ttft.count("llama", "default") == 2
    assert not any(name.endswith("_created") for name, _ in got)  # no _created series
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
    ("kvgate_open_admissions_total", "counter", ("model", "outcome")),  # issue 10 (added)
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
    ("kvgate_ttft_seconds", "histogram", ("model", "arm")),  # issue 12: arm added (sums keep working)
    ("kvgate_worker_full_total", "counter", ("model", "worker")),
    ("kvgate_workers", "gauge", ("model", "state")),
]


# issue 12 item 1: the operator metrics, added beside the names above
ADDED = [
    ("kvgate_estimated_cached_tokens_total", "counter", ("model", "worker")),
    ("kvgate_prefix_achieved_blocks_total", "counter", ("model",)),
    ("kvgate_prefix_reachable_blocks_total", "counter", ("model",)),
    ("kvgate_redis_errors_total", "counter", ()),
    ("kvgate_redis_roundtrip_seconds", "histogram", ()),
    ("kvgate_request_duration_seconds", "histogram", ("model", "arm")),
    ("kvgate_request_outcomes_total", "counter", ("model", "tenant", "band", "outcome", "arm")),
    ("kvgate_routing_reasons_total", "counter", ("model", "reason", "index", "arm")),
    ("kvgate_worker_cached_tokens_total", "counter", ("model", "worker")),
    ("kvgate_worker_inflight_requests", "gauge", ("model", "worker")),
    ("kvgate_worker_kv_usage_ratio", "gauge", ("model", "worker")),
    ("kvgate_worker_lease_age_seconds", "gauge", ("model", "worker")),
]


def test_exported_metric_names_kinds_and_labels_are_unchanged() -> None:
    m = GatewayMetrics()
    assert sorted((x.name, x.kind, tuple(x.label_names)) for x in m.all()) == sorted(EXPORTED + ADDED)
    text = m.render()
    for name, kind, _ in EXPORTED + ADDED:
        assert f"# TYPE {name} {kind}" in text


def test_two_gateways_in_one_process_keep_separate_registries() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    a.requests.inc("m", "normal", "200")
    assert a.requests.get("m", "normal", "200") == 1 and b.requests.get("m", "normal", "200") == 0


def test_outcome_and_reason_classes_are_bounded() -> None:
    assert [outcome_of(s) for s in (200, 429, 503, 400, 502)] == [
        "ok", "rate_limited", "unavailable", "client_error", "upstream_error"
    ]  # fmt: skip
    assert reason_class("sticky on w1 (prefix 0.50), predicted TTFT 0.1 s", True) == "stickiness"
    capped = "prefix 0.50 on w1 among replicas (cap), least predicted TTFT 0.1 s"
    assert reason_class(capped, True) == "replica_cap"
    assert reason_class("prefix 0.50 on w1, least predicted TTFT 0.1 s", True) == "cache_hit"
    assert reason_class("miss → least predicted TTFT 0.1 s on w1", False) == "load"
    assert reason_class("", False) == "fallback"
