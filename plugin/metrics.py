"""The gateway's Prometheus metrics, on prometheus-client with a registry of their own.

Each metric keeps its series in a plain dict (`_Family`), so the hot path pays one dict lookup and one
add per observation; a scrape collects them as prometheus-client metric families. There are no
`_created` series (they would double every counter's series and no dashboard reads them). The registry
is served at /metrics on the metrics port (plugin/metrics_server.py) only.
"""

from __future__ import annotations

import itertools
import math
import re
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.utils import floatToGoString

LabelValues = tuple[str, ...]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
TOKENIZE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
REDIS_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _Family:
    """One metric's series by label values, in a plain dict the hot path adds to: no lock and no
    prometheus-client call per observation (each cost several Python calls, bench.hook_cost). The
    registry collects a copy at scrape time through prometheus-client's own metric families, so the
    exposition is the one its Counter, Gauge and Histogram give for the same observations."""

    kind = ""
    family: Any = None  # the prometheus-client metric family class of the scrape

    def __init__(
        self, registry: CollectorRegistry, name: str, help_text: str, labels: tuple[str, ...] = ()
    ) -> None:
        self.name, self.help, self.label_names = name, help_text, labels
        self.series: dict[LabelValues, Any] = {}
        if not labels:  # a metric without labels has its one series from the start
            self.series[()] = self._zero()
        registry.register(self)

    def _zero(self) -> Any:
        return 0.0

    def _new(self, labels: LabelValues) -> Any:
        """The first observation of a label set (checked once, as prometheus-client's `labels()`)."""
        if len(labels) != len(self.label_names):
            raise ValueError(f"{self.name}: {len(labels)} label values for {self.label_names}")
        cell = self.series[labels] = self._zero()
        return cell

    def clear(self) -> None:
        self.series.clear()
        if not self.label_names:
            self.series[()] = self._zero()

    def forget(self, labels: LabelValues) -> None:
        self.series.pop(labels, None)

    def collect(self) -> Iterator[Any]:
        family = self.family(self.name, self.help, labels=self.label_names)
        for labels, cell in list(self.series.items()):  # a copy: the hot path adds meanwhile
            self._add(family, tuple(str(v) for v in labels), cell)
        yield family

    def describe(self) -> Iterator[Any]:
        yield self.family(self.name, self.help, labels=self.label_names)

    def _add(self, family: Any, labels: list[str] | tuple[str, ...], cell: Any) -> None:
        family.add_metric(labels, cell)


class Counter(_Family):
    kind, family = "counter", CounterMetricFamily

    def inc(self, *labels: str, by: float = 1.0) -> None:
        if by < 0:
            raise ValueError(f"{self.name}: counters only go up, not by {by}")
        series = self.series
        value = series.get(labels)
        series[labels] = (self._new(labels) if value is None else value) + by

    def get(self, *labels: str) -> float:
        return float(self.series.get(labels, 0.0))


class Gauge(_Family):
    kind, family = "gauge", GaugeMetricFamily

    def set(self, value: float, *labels: str) -> None:
        if labels not in self.series:
            self._new(labels)
        self.series[labels] = float(value)

    def get(self, *labels: str) -> float:
        return float(self.series.get(labels, 0.0))

    @property
    def values(self) -> dict[LabelValues, float]:
        return dict(self.series)


class Histogram(_Family):
    """Per label set one list: the count of each bucket (the first upper bound >= the value, +Inf
    last), then the sum of the values."""

    kind, family = "histogram", HistogramMetricFamily

    def __init__(
        self, registry: CollectorRegistry, name: str, help_text: str, labels: tuple[str, ...] = (),
        *, buckets: tuple[float, ...],
    ) -> None:  # fmt: skip
        self.bounds = [*map(float, buckets), *(() if buckets[-1] == math.inf else (math.inf,))]
        self.le = [floatToGoString(b) for b in self.bounds]  # type: ignore[no-untyped-call]
        super().__init__(registry, name, help_text, labels)

    def _zero(self) -> list[float]:
        return [0.0] * (len(self.bounds) + 1)

    def observe(self, value: float, *labels: str) -> None:
        cell = self.series.get(labels)
        if cell is None:
            cell = self._new(labels)
        cell[bisect_left(self.bounds, value)] += 1.0
        cell[-1] += value

    def count(self, *labels: str) -> int:
        cell = self.series.get(labels)
        return int(sum(cell[:-1])) if cell is not None else 0

    def _add(self, family: Any, labels: list[str] | tuple[str, ...], cell: Any) -> None:
        *counts, total = cell  # a copy: the hot path adds meanwhile
        cumulative = list(zip(self.le, itertools.accumulate(counts), strict=True))
        family.add_metric(labels, cumulative, sum_value=total)


class HotPathCpu:
    """Per-stage CPU of the hot path (the parts time their stages into FlowState.stage_ns), exported as
    a summary without quantiles: `_sum` (seconds) and `_count` (stage runs) per model, stage and arm.
    The hot path adds plain integers (no lock, no prometheus-client call); the scrape reads a copy."""

    kind = "summary"
    name = "kvgate_hot_path_cpu_seconds"
    label_names = ("model", "stage", "arm")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.cells: dict[LabelValues, list[int]] = {}  # (model, stage, arm) -> [stage runs, ns]
        # (model, arm) -> stage -> the same cell lists: a request's stages found without a key tuple each
        self._by_request: dict[tuple[str, str], dict[str, list[int]]] = {}
        registry.register(self)

    def add(self, model: str, stage: str, arm: str, ns: int) -> None:
        self.add_request(model, arm, {stage: ns})

    def add_request(self, model: str, arm: str, stage_ns: dict[str, int]) -> None:
        """One request's stages (FlowState.stage_ns), under its model and arm."""
        stages = self._by_request.get((model, arm))
        if stages is None:
            stages = self._by_request[model, arm] = {}
        for stage, ns in stage_ns.items():
            cell = stages.get(stage)
            if cell is None:
                cell = stages[stage] = self.cells.setdefault((model, stage, arm), [0, 0])
            cell[0] += 1
            cell[1] += ns

    def collect(self) -> Iterator[SummaryMetricFamily]:
        family = SummaryMetricFamily(
            self.name,
            "CPU of each hot-path stage (parse, hash, route, admit, release) on the event loop thread: "
            "time of its synchronous code, awaits excluded. Also tokenize (exact mode's token blocks, wall: "
            "a cold prompt's yields and a worker's /tokenize are in it) and index_feed (applying the "
            "index log's ops to the mirror, one run per batch, under the default arm).",
            labels=self.label_names,
        )
        for key, (calls, ns) in [(k, list(c)) for k, c in list(self.cells.items())]:  # the hot path adds
            family.add_metric(key, count_value=calls, sum_value=ns / 1e9)
        yield family

    def describe(self) -> Iterator[SummaryMetricFamily]:
        yield SummaryMetricFamily(self.name, "", labels=self.label_names)


# Every metric of the gateway: a line of attribute, kind (counter, gauge, or a histogram by its buckets),
# name and label names ("-": none), then its help text on the indented lines below it.
# Bounded labels only: tenants come from the config, workers from the registry, arms from the A/B split;
# never request ids or prefixes. `arm` is on every per-request metric (issue 12, A/B split).
DEFINITIONS = """
requests          counter   kvgate_requests_total                 model band status arm
    Completion requests finished, by status.
local             counter   kvgate_local_requests_total           path
    Requests answered by the gateway itself.
admission_wait    latency   kvgate_admission_wait_seconds         model band arm
    Time admitted requests waited for a slot.
rejected          counter   kvgate_admission_rejected_total       model reason arm
    Admission rejections.
queue_length      gauge     kvgate_queue_length                   model
    Requests of this gateway waiting for a slot.
worker_full       counter   kvgate_worker_full_total              model worker
    Requests turned down by a worker at its max_concurrency (two-step admission).
priority_clamped  counter   kvgate_priority_clamped_total         tenant
    Requests that asked for a band above their tenant's max_band (clamped to it).
open_admissions   counter   kvgate_open_admissions_total          model outcome
    Requests that found Redis unreachable in redis_failure = open: admitted within this gateway's local
    share, or refused past it (outcome: admitted, share_full).
retried           counter   kvgate_connect_retries_total          model worker
    Requests routed again because their worker refused the connection (nothing was sent).
global_queue      gauge     kvgate_global_queue_length            model band
    Requests of all gateways waiting for a slot (Redis).
seats_used        gauge     kvgate_seats_used                     model
    Seats held by live leases of all gateways (Redis).
expected_wait     gauge     kvgate_expected_queue_wait_seconds    model
    Expected wait of a request arriving now at the back of the global queues (autoscaling).
slot_drift        gauge     kvgate_slot_drift                     model
    Leases without a request in flight on a worker plus in-flight ids without a lease (audit).
inflight          gauge     kvgate_inflight_requests              model
    Requests this gateway routed and not finished.
routed            counter   kvgate_routing_decisions_total        model worker kind arm
    Routing decisions, by worker and kind (hit, miss).
ttft              latency   kvgate_ttft_seconds                   model arm
    Time to first token seen by the gateway.
output_tokens     counter   kvgate_output_tokens_total            model arm
    Output tokens streamed.
prompt_tokens     counter   kvgate_prompt_tokens_total            model arm
    Prompt tokens (worker usage).
cached_tokens     counter   kvgate_cached_tokens_total            model arm
    Prompt tokens served from the worker's prefix cache.
workers           gauge     kvgate_workers                        model state
    Workers in the mirror, by state.
draining          gauge     kvgate_draining                       -
    1 while the gateway drains on SIGTERM.
tokenized         counter   kvgate_tokenize_total                 model source
    Exact-mode prompts hashed from token ids, by source (worker, cache, prompt).
tokenize_seconds  tokenize  kvgate_tokenize_seconds               model
    Exact mode: /tokenize round trips to a worker.
prefix_fallbacks  counter   kvgate_prefix_fallbacks_total         model reason
    Exact-mode requests routed on approximate hashes, by reason (timeout, error, ...).
outcomes          counter   kvgate_request_outcomes_total         model tenant band outcome arm
    Requests finished, by model, tenant, band, outcome (ok, rate_limited, unavailable, client_error,
    upstream_error) and A/B arm.
reasons           counter   kvgate_routing_reasons_total          model reason index arm
    Routing decisions by reason (policy.types.ReasonKind: cache_hit, load, stickiness, exploration,
    replica_cap, session, fallback) and the index kind that matched (exact, speculative, approximate, none).
prefix_switches   counter   kvgate_prefix_switches_total          model arm
    Requests routed to another worker than their prefix's previous request went to.
duration          latency   kvgate_request_duration_seconds       model arm
    End-to-end time of routed requests seen by the gateway.
estimated_cached  counter   kvgate_estimated_cached_tokens_total  model worker arm
    Prompt tokens the gateway expected the chosen worker to have cached (its index hit share of the prompt).
actual_cached     counter   kvgate_worker_cached_tokens_total     model worker arm
    Prompt tokens the worker reported cached (usage.prompt_tokens_details), by worker.
index_unlearnt    counter   kvgate_index_unlearnt_entries_total   model worker
    Index entries hit feedback dropped: the worker reported fewer cached tokens than expected.
reachable_blocks  counter   kvgate_prefix_reachable_blocks_total  model arm
    Best prefix hit (blocks) any candidate worker had, summed over routed requests.
achieved_blocks   counter   kvgate_prefix_achieved_blocks_total   model arm
    Prefix hit (blocks) of the chosen worker, summed over routed requests.
worker_inflight   gauge     kvgate_worker_inflight_requests       model worker
    Requests this gateway has in flight on a worker.
worker_kv_usage   gauge     kvgate_worker_kv_usage_ratio          model worker
    A worker's KV-cache usage (0..1) as the gateway's mirror sees it.
worker_lease_age  gauge     kvgate_worker_lease_age_seconds       model worker
    Seconds since a worker's lease was last renewed, as the gateway's mirror sees it.
redis_seconds     redis     kvgate_redis_roundtrip_seconds        -
    Round trips to Redis (PING of the metrics refresher).
redis_errors      counter   kvgate_redis_errors_total             -
    Failed Redis round trips of the metrics refresher.
session_routes    counter   kvgate_session_routes_total           model outcome
    Requests with a session id, by what the session did (new, followed, decided, moved).
sessions_closed   counter   kvgate_sessions_closed_total          model
    Sessions their client closed (x-kvgate-session-close).
"""
HISTOGRAM_BUCKETS = {"latency": LATENCY_BUCKETS_S, "tokenize": TOKENIZE_BUCKETS_S, "redis": REDIS_BUCKETS_S}


def _definitions(table: str) -> Iterator[tuple[str, str]]:
    """(spec line, help text) per metric of a DEFINITIONS table."""
    for block in re.split(r"\n(?=\S)", table.strip()):
        spec, *help_lines = block.splitlines()
        yield spec, " ".join(line.strip() for line in help_lines)


class GatewayMetrics:
    """Every metric the gateway exports, by attribute (built from DEFINITIONS, in a registry of its own)."""

    requests: Counter
    local: Counter
    admission_wait: Histogram
    rejected: Counter
    queue_length: Gauge
    worker_full: Counter
    priority_clamped: Counter
    open_admissions: Counter
    retried: Counter
    global_queue: Gauge
    seats_used: Gauge
    expected_wait: Gauge
    slot_drift: Gauge
    inflight: Gauge
    routed: Counter
    ttft: Histogram
    output_tokens: Counter
    prompt_tokens: Counter
    cached_tokens: Counter
    workers: Gauge
    draining: Gauge
    tokenized: Counter
    tokenize_seconds: Histogram
    prefix_fallbacks: Counter
    outcomes: Counter
    reasons: Counter
    prefix_switches: Counter
    duration: Histogram
    estimated_cached: Counter
    actual_cached: Counter
    index_unlearnt: Counter
    reachable_blocks: Counter
    achieved_blocks: Counter
    worker_inflight: Gauge
    worker_kv_usage: Gauge
    worker_lease_age: Gauge
    redis_seconds: Histogram
    redis_errors: Counter
    session_routes: Counter
    sessions_closed: Counter

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        for spec, help_text in _definitions(DEFINITIONS):
            attr, kind, name, *labels = spec.split()
            names = () if labels == ["-"] else tuple(labels)
            family: _Family
            if kind == "counter":
                family = Counter(r, name, help_text, names)
            elif kind == "gauge":
                family = Gauge(r, name, help_text, names)
            else:
                family = Histogram(r, name, help_text, names, buckets=HISTOGRAM_BUCKETS[kind])
            setattr(self, attr, family)
        self.hot_path_cpu = HotPathCpu(r)

    def all(self) -> list[_Family | HotPathCpu]:
        return [m for m in vars(self).values() if isinstance(m, _Family | HotPathCpu)]

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def drop_workers_except(self, present: set[tuple[str, str]]) -> None:
        """Forget the series of every (model, worker) not in `present` (workers that left the mirror),
        so a dead worker's series do not stay in every scrape for ever."""
        for family in self.all():
            if not isinstance(family, _Family) or family.label_names[:2] != ("model", "worker"):
                continue
            for labels in [k for k in family.series if (k[0], k[1]) not in present]:
                family.forget(labels)


def outcome_of(status: int) -> str:
    """A bounded outcome class for a final status."""
    if status < 400:
        return "ok"
    if status == 429:
        return "rate_limited"
    if status == 503:
        return "unavailable"
    return "client_error" if status < 500 else "upstream_error"
