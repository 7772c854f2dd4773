"""The gateway's Prometheus metrics, rendered as text exposition format at GET /metrics.

A deliberately small registry (counters, gauges, histograms with labels) so the hot path pays a
dict update per observation and nothing else; no client library is needed.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

LabelValues = tuple[str, ...]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: LabelValues, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class Counter:
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, labels
        self.values: dict[LabelValues, float] = {}

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def samples(self) -> Iterable[str]:
        for labels, value in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.label_names, labels)} {value:g}"


class Gauge(Counter):
    """A value set directly, or read from `source` (a callable returning {labels: value}) at scrape time."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: tuple[str, ...] = (),
        source: Callable[[], dict[LabelValues, float]] | None = None,
    ) -> None:
        super().__init__(name, help_text, labels)
        self.source = source

    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = value

    def samples(self) -> Iterable[str]:
        if self.source is not None:
            self.values = dict(self.source())
        return super().samples()


class Histogram:
    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name, self.help, self.label_names, self.buckets = name, help_text, labels, buckets
        self.counts: dict[LabelValues, list[int]] = {}
        self.sums: dict[LabelValues, float] = {}

    def observe(self, value: float, *labels: str) -> None:
        counts = self.counts.get(labels)
        if counts is None:
            counts = self.counts[labels] = [0] * (len(self.buckets) + 1)
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[labels] = self.sums.get(labels, 0.0) + value

    def count(self, *labels: str) -> int:
        return sum(self.counts.get(labels, ()))

    def samples(self) -> Iterable[str]:
        for labels, counts in sorted(self.counts.items()):
            running = 0
            for bound, n in zip((*self.buckets, float("inf")), counts, strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                bucket_labels = _labels(self.label_names, labels, 'le="' + le + '"')
                yield f"{self.name}_bucket{bucket_labels} {running}"
            yield f"{self.name}_sum{_labels(self.label_names, labels)} {self.sums[labels]:g}"
            yield f"{self.name}_count{_labels(self.label_names, labels)} {running}"


class GatewayMetrics:
    """Every metric the gateway exports, by name."""

    def __init__(self) -> None:
        self.requests = Counter(
            "kvgate_requests_total", "Completion requests finished, by status.", ("model", "band", "status")
        )
        self.local = Counter(
            "kvgate_local_requests_total", "Requests answered by the gateway itself.", ("path",)
        )
        self.admission_wait = Histogram(
            "kvgate_admission_wait_seconds", "Time admitted requests waited for a slot.", ("model", "band"),
            LATENCY_BUCKETS_S,
        )  # fmt: skip
        self.rejected = Counter(
            "kvgate_admission_rejected_total", "Admission rejections.", ("model", "reason")
        )
        self.queue_length = Gauge(
            "kvgate_queue_length", "Requests of this gateway waiting for a slot.", ("model",)
        )
        self.worker_full = Counter(
            "kvgate_worker_full_total",
            "Requests turned down by a worker at its max_concurrency (two-step admission).",
            ("model", "worker"),
        )
        self.priority_clamped = Counter(
            "kvgate_priority_clamped_total",
            "Requests that asked for a band above their tenant's max_band (clamped to it).",
            ("tenant",),
        )
        self.retried = Counter(
            "kvgate_connect_retries_total",
            "Requests routed again because their worker refused the connection (nothing was sent).",
            ("model", "worker"),
        )
        self.global_queue = Gauge(
            "kvgate_global_queue_length",
            "Requests of all gateways waiting for a slot (Redis).",
            ("model", "band"),
        )
        self.seats_used = Gauge(
            "kvgate_seats_used", "Seats held by live leases of all gateways (Redis).", ("model",)
        )
        self.expected_wait = Gauge(
            "kvgate_expected_queue_wait_seconds",
            "Expected wait of a request arriving now at the back of the global queues (autoscaling).",
            ("model",),
        )
        self.slot_drift = Gauge(
            "kvgate_slot_drift",
            "Leases without a request in flight on a worker plus in-flight ids without a lease (audit).",
            ("model",),
        )
        self.inflight = Gauge(
            "kvgate_inflight_requests", "Requests this gateway routed and not finished.", ("model",)
        )
        self.routed = Counter(
            "kvgate_routing_decisions_total",
            "Routing decisions, by worker and kind.",
            ("model", "worker", "kind"),
        )
        self.ttft = Histogram(
            "kvgate_ttft_seconds", "Time to first token seen by the gateway.", ("model",), LATENCY_BUCKETS_S
        )
        self.output_tokens = Counter("kvgate_output_tokens_total", "Output tokens streamed.", ("model",))
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens_total", "Prompt tokens (worker usage).", ("model",)
        )
        self.cached_tokens = Counter(
            "kvgate_cached_tokens_total", "Prompt tokens served from the worker's prefix cache.", ("model",)
        )
        self.workers = Gauge("kvgate_workers", "Workers in the mirror, by state.", ("model", "state"))
        self.draining = Gauge("kvgate_draining", "1 while the gateway drains on SIGTERM.")
        # exact prefix mode (plugin/tokenize.py)
        self.tokenized = Counter(
            "kvgate_tokenize_total",
            "Exact-mode prompts hashed from token ids, by source (worker, cache, prompt).",
            ("model", "source"),
        )
        self.tokenize_seconds = Histogram(
            "kvgate_tokenize_seconds", "Exact mode: /tokenize round trips to a worker.", ("model",),
            (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
        )  # fmt: skip
        self.prefix_fallbacks = Counter(
            "kvgate_prefix_fallbacks_total",
            "Exact-mode requests routed on approximate hashes, by reason (timeout, error, ...).",
            ("model", "reason"),
        )

        # explicit session affinity (plugin/sessions.py, policy/session.py)
        self.session_routes = Counter(
            "kvgate_session_routes_total",
            "Requests with a session id, by what the session did (new, followed, decided, moved).",
            ("model", "outcome"),
        )
        self.sessions_closed = Counter(
            "kvgate_sessions_closed_total",
            "Sessions their client closed (x-kvgate-session-close).",
            ("model",),
        )

    def all(self) -> list[Counter | Histogram]:
        return [m for m in vars(self).values() if isinstance(m, Counter | Histogram)]

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.all():
            lines.append(f"# HELP {metric.name} {metric.help}")
            lines.append(f"# TYPE {metric.name} {metric.kind}")
            lines.extend(metric.samples())
        return "\n".join(lines) + "\n"
