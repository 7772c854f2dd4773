"""The Prometheus text the gateway exports parses line by line and counts what was observed."""

from __future__ import annotations

import prometheus_client

from plugin.metrics import DEFINITIONS, GatewayMetrics, outcome_of
from policy.types import ReasonKind
from tests.prom import samples


def test_render() -> None:
    m = GatewayMetrics()
    m.requests.inc("llama", "high", "200", "default")
    m.requests.inc("llama", "high", "200", "default")
    m.ttft.observe(0.03, "llama", "default")
    m.ttft.observe(7.0, "llama", "default")
    m.routed.inc("llama", 'w"1', "prefix", "default")
    text = m.render()
    got = samples(text)

    def at(name: str, **labels: str) -> float:
        return got[name, frozenset(labels.items())]

    assert at("kvgate_requests_total", model="llama", band="high", status="200", arm="default") == 2
    assert at("kvgate_ttft_seconds_bucket", model="llama", arm="default", le="0.05") == 1
    assert at("kvgate_ttft_seconds_bucket", model="llama", arm="default", le="+Inf") == 2
    assert at("kvgate_ttft_seconds_count", model="llama", arm="default") == 2
    assert (
        at("kvgate_routing_decisions_total", model="llama", worker='w"1', kind="prefix", arm="default") == 1
    )
    assert m.requests.get("llama", "high", "200", "default") == 2 and m.ttft.count("llama", "default") == 2
    assert not any(name.endswith("_created") for name, _ in got)  # no _created series
    assert "# TYPE kvgate_ttft_seconds histogram" in text


# The exported contract (dashboards, alerts, docs/GATEWAY.md): names, kinds and label names, as on
# main before the layout refactor. A change here is a breaking change for every scraper; an added label
# (`arm`, issue 12) is not: every name stays, and sums over the old labels read as before.
EXPORTED = [
    ("kvgate_admission_rejected_total", "counter", ("model", "reason", "arm")),  # issue 12: arm added
    ("kvgate_admission_wait_seconds", "histogram", ("model", "band", "arm")),  # issue 12: arm added
    ("kvgate_cached_tokens_total", "counter", ("model", "arm")),  # issue 12: arm added
    ("kvgate_connect_retries_total", "counter", ("model", "worker")),  # issue 10 (added)
    ("kvgate_draining", "gauge", ()),
    ("kvgate_expected_queue_wait_seconds", "gauge", ("model",)),
    ("kvgate_global_queue_length", "gauge", ("model", "band")),
    ("kvgate_inflight_requests", "gauge", ("model",)),
    ("kvgate_local_requests_total", "counter", ("path",)),
    ("kvgate_open_admissions_total", "counter", ("model", "outcome")),  # issue 10 (added)
    ("kvgate_output_tokens_total", "counter", ("model", "arm")),  # issue 12: arm added
    ("kvgate_prefix_fallbacks_total", "counter", ("model", "reason")),
    ("kvgate_priority_clamped_total", "counter", ("tenant",)),  # issue 10 (added)
    ("kvgate_prompt_tokens_total", "counter", ("model", "arm")),  # issue 12: arm added
    ("kvgate_queue_length", "gauge", ("model",)),
    ("kvgate_requests_total", "counter", ("model", "band", "status", "arm")),  # issue 12: arm added
    ("kvgate_routing_decisions_total", "counter", ("model", "worker", "kind", "arm")),  # issue 12: arm
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
    ("kvgate_estimated_cached_tokens_total", "counter", ("model", "worker", "arm")),
    ("kvgate_prefix_achieved_blocks_total", "counter", ("model", "arm")),
    ("kvgate_prefix_reachable_blocks_total", "counter", ("model", "arm")),
    ("kvgate_prefix_switches_total", "counter", ("model", "arm")),
    ("kvgate_hot_path_cpu_seconds", "summary", ("model", "stage", "arm")),
    ("kvgate_redis_errors_total", "counter", ()),
    ("kvgate_redis_roundtrip_seconds", "histogram", ()),
    ("kvgate_request_duration_seconds", "histogram", ("model", "arm")),
    ("kvgate_request_outcomes_total", "counter", ("model", "tenant", "band", "outcome", "arm")),
    ("kvgate_routing_reasons_total", "counter", ("model", "reason", "index", "arm")),
    ("kvgate_worker_cached_tokens_total", "counter", ("model", "worker", "arm")),
    ("kvgate_worker_inflight_requests", "gauge", ("model", "worker")),
    ("kvgate_worker_kv_usage_ratio", "gauge", ("model", "worker")),
    ("kvgate_worker_lease_age_seconds", "gauge", ("model", "worker")),
    ("kvgate_index_unlearnt_entries_total", "counter", ("model", "worker")),  # session 12: hit feedback
]


def test_exported_metric_names_kinds_and_labels_are_unchanged() -> None:
    m = GatewayMetrics()
    assert sorted((x.name, x.kind, tuple(x.label_names)) for x in m.all()) == sorted(EXPORTED + ADDED)
    text = m.render()
    for name, kind, _ in EXPORTED + ADDED:
        assert f"# TYPE {name} {kind}" in text


def test_two_gateways_in_one_process_keep_separate_registries() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    a.requests.inc("m", "normal", "200", "default")
    assert (
        a.requests.get("m", "normal", "200", "default") == 1
        and b.requests.get("m", "normal", "200", "default") == 0
    )


def test_outcome_classes_are_bounded() -> None:
    assert [outcome_of(s) for s in (200, 429, 503, 400, 502)] == [
        "ok", "rate_limited", "unavailable", "client_error", "upstream_error"
    ]  # fmt: skip


def test_every_attribute_is_defined_once_in_the_table() -> None:
    m = GatewayMetrics()
    declared = set(GatewayMetrics.__annotations__)
    assert declared == set(vars(m)) - {"registry", "hot_path_cpu"}
    rows = [line for line in DEFINITIONS.strip().splitlines() if not line[0].isspace()]
    assert len(rows) == len(declared)


def test_hot_path_cpu_is_a_summary_per_stage_and_arm() -> None:
    m = GatewayMetrics()
    m.hot_path_cpu.add("m", "route", "default", 30_000)
    m.hot_path_cpu.add("m", "route", "default", 10_000)
    got = samples(m.render())
    assert (
        got[
            "kvgate_hot_path_cpu_seconds_count",
            frozenset({("model", "m"), ("stage", "route"), ("arm", "default")}),
        ]
        == 2
    )
    total = got[
        "kvgate_hot_path_cpu_seconds_sum", frozenset({("model", "m"), ("stage", "route"), ("arm", "default")})
    ]
    assert abs(total - 40e-6) < 1e-12
    for _ in range(3):  # a request's stages at once, under another arm: their own series
        m.hot_path_cpu.add_request("m", "b", {"parse": 1_000, "route": 2_000})
    m.hot_path_cpu.add_request("m", "default", {"route": 5_000})
    got = samples(m.render())

    def count_sum(stage: str, arm: str) -> tuple[float, float]:
        labels = frozenset({("model", "m"), ("stage", stage), ("arm", arm)})
        return got["kvgate_hot_path_cpu_seconds_count", labels], got[
            "kvgate_hot_path_cpu_seconds_sum", labels
        ]

    assert count_sum("parse", "b") == (3, 3e-6) and count_sum("route", "b") == (3, 6e-6)
    assert count_sum("route", "default")[0] == 3 and abs(count_sum("route", "default")[1] - 45e-6) < 1e-12


def test_series_of_workers_that_left_are_dropped() -> None:
    m = GatewayMetrics()
    for w in ("w1", "w2"):
        m.worker_kv_usage.set(0.5, "m", w)
        m.routed.inc("m", w, "hit", "default")
    m.drop_workers_except({("m", "w1")})
    text = m.render()
    assert 'worker="w1"' in text and 'worker="w2"' not in text
    m.routed.inc("m", "w2", "hit", "default")  # it came back: a new series from 1
    assert m.routed.get("m", "w2", "hit", "default") == 1


def test_exposition_is_prometheus_clients_own_for_the_same_observations() -> None:
    """The plain-dict families render byte for byte what prometheus-client's Counter, Gauge and
    Histogram render for the same observations (the registered metrics they replace on the hot path)."""
    m = GatewayMetrics()
    reference = prometheus_client.CollectorRegistry()
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    buckets = m.ttft.bounds[:-1]
    counter = prometheus_client.Counter(
        "kvgate_routing_reasons_total", m.reasons.help, m.reasons.label_names, registry=reference
    )
    gauge = prometheus_client.Gauge("kvgate_draining", m.draining.help, registry=reference)
    histogram = prometheus_client.Histogram(
        "kvgate_ttft_seconds", m.ttft.help, m.ttft.label_names, registry=reference, buckets=buckets
    )
    errors = prometheus_client.Counter("kvgate_redis_errors_total", m.redis_errors.help, registry=reference)
    for i, value in enumerate([0.003, 0.01, 0.0100001, 7.0, 61.0, 0.2, 0.01, 1e-9]):
        arm = ("default", "candidate")[i % 2]
        m.reasons.inc("llama", ReasonKind.CACHE_HIT, "exact", arm, by=value * 1000)
        counter.labels("llama", ReasonKind.CACHE_HIT, "exact", arm).inc(value * 1000)
        m.ttft.observe(value, "llama", arm)
        histogram.labels("llama", arm).observe(value)
        m.draining.set(i)
        gauge.set(i)
    m.redis_errors.inc()
    errors.inc()
    ours = {f.name: f for f in m.registry.collect()}
    theirs = {f.name: f for f in reference.collect()}
    assert len(theirs) == 4 and set(theirs) <= set(ours)
    for name, family in theirs.items():
        assert (ours[name].documentation, ours[name].type, ours[name].samples) == (
            family.documentation, family.type, family.samples,
        )  # fmt: skip
    assert 'le="0.01"' in m.render() and m.ttft.count("llama", "default") == 4
