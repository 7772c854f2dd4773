"""The gateway's Prometheus metrics, on prometheus-client with a registry of their own.

Each metric keeps the prometheus-client child of every label set it has seen, so the hot path pays
one dict lookup and the child's locked add per observation. `_created` series are off (they double
every counter's series and no dashboard reads them). The registry is served at /metrics on the
metrics port (plugin/metrics_server.py) only.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest

LabelValues = tuple[str, ...]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
REDIS_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _Family:
    """One prometheus-client metric and its children by label values."""

    kind = ""

    def __init__(self, metric: Any, name: str, labels: tuple[str, ...]) -> None:
        self.metric, self.name, self.label_names = metric, name, labels
        self.children: dict[LabelValues, Any] = {}

    def child(self, labels: LabelValues) -> Any:
        child = self.children.get(labels)
        if child is None:
            child = self.children[labels] = self.metric.labels(*labels) if self.label_names else self.metric
        return child

    def clear(self) -> None:
        self.children.clear()
        if self.label_names:
            self.metric.clear()

    def sample(self, suffix: str, labels: LabelValues) -> float:
        """A sample's value read back from the registry (tests and scrape-time code, not the hot path)."""
        want = dict(zip(self.label_names, labels, strict=True))
        for family in self.metric.collect():
            for s in family.samples:
                if s.name == self.name.removesuffix("_total") + suffix and s.labels == want:
                    return float(s.value)
        return 0.0


class Counter(_Family):
    kind = "counter"

    def __init__(
        self, registry: CollectorRegistry, name: str, help_text: str, labels: tuple[str, ...] = ()
    ) -> None:
        metric = prometheus_client.Counter(name, help_text, labels, registry=registry)
        super().__init__(metric, name, labels)

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self.child(labels).inc(by)

    def get(self, *labels: str) -> float:
        return self.sample("_total", labels) if labels in self.children else 0.0


class Gauge(_Family):
    kind = "gauge"

    def __init__(
        self, registry: CollectorRegistry, name: str, help_text: str, labels: tuple[str, ...] = ()
    ) -> None:
        metric = prometheus_client.Gauge(name, help_text, labels, registry=registry)
        super().__init__(metric, name, labels)

    def set(self, value: float, *labels: str) -> None:
        self.child(labels).set(value)

    def get(self, *labels: str) -> float:
        return self.sample("", labels) if labels in self.children else 0.0

    @property
    def values(self) -> dict[LabelValues, float]:
        return {labels: self.sample("", labels) for labels in self.children}


class Histogram(_Family):
    kind = "histogram"

    def __init__(
        self, registry: CollectorRegistry, name: str, help_text: str, labels: tuple[str, ...],
        buckets: tuple[float, ...],
    ) -> None:  # fmt: skip
        metric = prometheus_client.Histogram(name, help_text, labels, registry=registry, buckets=buckets)
        super().__init__(metric, name, labels)

    def observe(self, value: float, *labels: str) -> None:
        self.child(labels).observe(value)

    def count(self, *labels: str) -> int:
        return int(self.sample("_count", labels)) if labels in self.children else 0


class GatewayMetrics:
    """Every metric the gateway exports, by name."""

    def __init__(self) -> None:
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # idempotent
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            r,
            "kvgate_requests_total",
            "Completion requests finished, by status.",
            ("model", "band", "status"),
        )
        self.local = Counter(
            r, "kvgate_local_requests_total", "Requests answered by the gateway itself.", ("path",)
        )
        self.admission_wait = Histogram(
            r, "kvgate_admission_wait_seconds", "Time admitted requests waited for a slot.",
            ("model", "band"), LATENCY_BUCKETS_S,
        )  # fmt: skip
        self.rejected = Counter(
            r, "kvgate_admission_rejected_total", "Admission rejections.", ("model", "reason")
        )
        self.queue_length = Gauge(
            r, "kvgate_queue_length", "Requests of this gateway waiting for a slot.", ("model",)
        )
        self.worker_full = Counter(
            r,
            "kvgate_worker_full_total",
            "Requests turned down by a worker at its max_concurrency (two-step admission).",
            ("model", "worker"),
        )
        self.priority_clamped = Counter(
            r,
            "kvgate_priority_clamped_total",
            "Requests that asked for a band above their tenant's max_band (clamped to it).",
            ("tenant",),
        )
        self.open_admissions = Counter(
            r,
            "kvgate_open_admissions_total",
            "Requests that found Redis unreachable in redis_failure = open: admitted within this "
            "gateway's local share, or refused past it (outcome: admitted, share_full).",
            ("model", "outcome"),
        )
        self.retried = Counter(
            r,
            "kvgate_connect_retries_total",
            "Requests routed again because their worker refused the connection (nothing was sent).",
            ("model", "worker"),
        )
        self.global_queue = Gauge(
            r,
            "kvgate_global_queue_length",
            "Requests of all gateways waiting for a slot (Redis).",
            ("model", "band"),
        )
        self.seats_used = Gauge(
            r, "kvgate_seats_used", "Seats held by live leases of all gateways (Redis).", ("model",)
        )
        self.expected_wait = Gauge(
            r,
            "kvgate_expected_queue_wait_seconds",
            "Expected wait of a request arriving now at the back of the global queues (autoscaling).",
            ("model",),
        )
        self.slot_drift = Gauge(
            r,
            "kvgate_slot_drift",
            "Leases without a request in flight on a worker plus in-flight ids without a lease (audit).",
            ("model",),
        )
        self.inflight = Gauge(
            r, "kvgate_inflight_requests", "Requests this gateway routed and not finished.", ("model",)
        )
        self.routed = Counter(
            r,
            "kvgate_routing_decisions_total",
            "Routing decisions, by worker and kind.",
            ("model", "worker", "kind"),
        )
        self.ttft = Histogram(
            r,
            "kvgate_ttft_seconds",
            "Time to first token seen by the gateway.",
            ("model", "arm"),
            LATENCY_BUCKETS_S,
        )
        self.output_tokens = Counter(r, "kvgate_output_tokens_total", "Output tokens streamed.", ("model",))
        self.prompt_tokens = Counter(
            r, "kvgate_prompt_tokens_total", "Prompt tokens (worker usage).", ("model",)
        )
        self.cached_tokens = Counter(
            r,
            "kvgate_cached_tokens_total",
            "Prompt tokens served from the worker's prefix cache.",
            ("model",),
        )
        self.workers = Gauge(r, "kvgate_workers", "Workers in the mirror, by state.", ("model", "state"))
        self.draining = Gauge(r, "kvgate_draining", "1 while the gateway drains on SIGTERM.")
        # exact prefix mode (plugin/tokenize.py)
        self.tokenized = Counter(
            r,
            "kvgate_tokenize_total",
            "Exact-mode prompts hashed from token ids, by source (worker, cache, prompt).",
            ("model", "source"),
        )
        self.tokenize_seconds = Histogram(
            r, "kvgate_tokenize_seconds", "Exact mode: /tokenize round trips to a worker.", ("model",),
            (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
        )  # fmt: skip
        self.prefix_fallbacks = Counter(
            r,
            "kvgate_prefix_fallbacks_total",
            "Exact-mode requests routed on approximate hashes, by reason (timeout, error, ...).",
            ("model", "reason"),
        )

        # issue 12: operator metrics (bounded labels: tenants come from the config, workers from the
        # registry, arms from the A/B split; never request ids or prefixes)
        self.outcomes = Counter(
            r,
            "kvgate_request_outcomes_total",
            "Requests finished, by model, tenant, band, outcome (ok, rate_limited, unavailable, "
            "client_error, upstream_error) and A/B arm.",
            ("model", "tenant", "band", "outcome", "arm"),
        )
        self.reasons = Counter(
            r,
            "kvgate_routing_reasons_total",
            "Routing decisions by reason (cache_hit, load, stickiness, replica_cap, fallback) and the "
            "index kind that matched (approximate, exact, none).",
            ("model", "reason", "index", "arm"),
        )
        self.duration = Histogram(
            r, "kvgate_request_duration_seconds", "End-to-end time of routed requests seen by the gateway.",
            ("model", "arm"), LATENCY_BUCKETS_S,
        )  # fmt: skip
        self.estimated_cached = Counter(
            r,
            "kvgate_estimated_cached_tokens_total",
            "Prompt tokens the gateway expected the chosen worker to have cached (its index hit share of "
            "the prompt).",
            ("model", "worker"),
        )
        self.actual_cached = Counter(
            r,
            "kvgate_worker_cached_tokens_total",
            "Prompt tokens the worker reported cached (usage.prompt_tokens_details), by worker.",
            ("model", "worker"),
        )
        self.reachable_blocks = Counter(
            r,
            "kvgate_prefix_reachable_blocks_total",
            "Best prefix hit (blocks) any candidate worker had, summed over routed requests.",
            ("model",),
        )
        self.achieved_blocks = Counter(
            r,
            "kvgate_prefix_achieved_blocks_total",
            "Prefix hit (blocks) of the chosen worker, summed over routed requests.",
            ("model",),
        )
        self.worker_inflight = Gauge(
            r,
            "kvgate_worker_inflight_requests",
            "Requests this gateway has in flight on a worker.",
            ("model", "worker"),
        )
        self.worker_kv_usage = Gauge(
            r,
            "kvgate_worker_kv_usage_ratio",
            "A worker's KV-cache usage (0..1) as the gateway's mirror sees it.",
            ("model", "worker"),
        )
        self.worker_lease_age = Gauge(
            r,
            "kvgate_worker_lease_age_seconds",
            "Seconds since a worker's lease was last renewed, as the gateway's mirror sees it.",
            ("model", "worker"),
        )
        self.redis_seconds = Histogram(
            r, "kvgate_redis_roundtrip_seconds", "Round trips to Redis (PING of the metrics refresher).",
            (), REDIS_BUCKETS_S,
        )  # fmt: skip
        self.redis_errors = Counter(
            r, "kvgate_redis_errors_total", "Failed Redis round trips of the metrics refresher.", ()
        )
        # explicit session affinity (plugin/sessions.py, policy/session.py)
        self.session_routes = Counter(
            r,
            "kvgate_session_routes_total",
            "Requests with a session id, by what the session did (new, followed, decided, moved).",
            ("model", "outcome"),
        )
        self.sessions_closed = Counter(
            r,
            "kvgate_sessions_closed_total",
            "Sessions their client closed (x-kvgate-session-close).",
            ("model",),
        )

    def all(self) -> list[_Family]:
        return [m for m in vars(self).values() if isinstance(m, _Family)]

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def outcome_of(status: int) -> str:
    """A bounded outcome class for a final status."""
    if status < 400:
        return "ok"
    if status == 429:
        return "rate_limited"
    if status == 503:
        return "unavailable"
    return "client_error" if status < 500 else "upstream_error"


def reason_class(reason: str, hit: bool) -> str:
    """The bounded class of a policy's free-text decision reason (policy/kvgate.py `_reason`)."""
    if reason.startswith("sticky"):
        return "stickiness"
    if "(cap)" in reason or "replica" in reason:
        return "replica_cap"
    if reason.startswith("prefix") or (hit and not reason.startswith("miss")):
        return "cache_hit"
    if reason.startswith("miss") or reason:
        return "load"
    return "fallback"
