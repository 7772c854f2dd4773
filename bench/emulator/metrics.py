"""Prometheus metrics of the emulated worker, with vLLM's names and labels, and a small text parser.

The emulator's request-side counters live in `RequestMetrics`; the engine's gauges and counters
are passed to `render()` as an `EngineSnapshot` taken at scrape time. Names follow vLLM V1
(`vllm/v1/metrics/loggers.py`, shared/reference/PEERS.md §3.6): labels `model_name` and `engine`,
counters with a `_total` suffix, `vllm:cache_config_info` an info gauge of value 1. Latencies are
wall-clock seconds, i.e. what a client of this server observes.
Own metrics: `kvgate_emulator_max_concurrent_requests` (the most requests ever held at once) and
`kvgate_emulator_requests_total`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from runtime.exposition import text_of

# vLLM's buckets (seconds)
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
E2E_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last = +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass
class RequestMetrics:
    """What the HTTP layer counts; one instance per server."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    in_flight: int = 0
    max_concurrent: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def request_started(self, prompt_tokens: int) -> None:
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        self.in_flight += 1
        self.max_concurrent = max(self.max_concurrent, self.in_flight)

    def request_ended(self, generated_tokens: int) -> None:
        self.in_flight -= 1
        self.generation_tokens_total += generated_tokens


@dataclass(frozen=True)
class EngineSnapshot:
    running: int
    waiting: int
    kv_usage: float  # 0..1
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    block_size: int
    num_gpu_blocks: int


def _histogram(name: str, help_text: str, hist: Histogram, labels: Mapping[str, str]) -> Metric:
    family = HistogramMetricFamily(name, help_text, labels=list(labels))
    cumulative = list(itertools.accumulate(hist.counts))
    uppers = [repr(upper) for upper in hist.buckets] + ["+Inf"]
    family.add_metric(list(labels.values()), list(zip(uppers, cumulative, strict=True)), hist.total)
    return family


def render(model_name: str, requests: RequestMetrics, engine: EngineSnapshot) -> str:
    """The /metrics body (Prometheus text format 0.0.4, written by prometheus-client as vLLM's is)."""
    lab = {"model_name": model_name, "engine": "0"}
    config = {
        "block_size": engine.block_size,
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "engine": "0",
        "gpu_memory_utilization": "0.9",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": engine.num_gpu_blocks,
    }
    # (family, type, help, value); counters get the `_total` suffix on their sample
    simple: list[tuple[str, str, str, float]] = [
        (
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            engine.running,
        ),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", engine.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage),
        (
            "vllm:prefix_cache_queries",
            "counter",
            "Prefix cache queries, in queried tokens.",
            engine.prefix_cache_queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "counter",
            "Prefix cache hits, in cached tokens.",
            engine.prefix_cache_hits,
        ),
        (
            "vllm:num_preemptions",
            "counter",
            "Cumulative number of preemption from the engine.",
            engine.num_preemptions,
        ),
        (
            "vllm:prompt_tokens",
            "counter",
            "Number of prefill tokens processed.",
            requests.prompt_tokens_total,
        ),
        (
            "vllm:generation_tokens",
            "counter",
            "Number of generation tokens processed.",
            requests.generation_tokens_total,
        ),
        (
            "kvgate_emulator_max_concurrent_requests",
            "gauge",
            "Most requests this emulated worker ever held at once (HTTP requests in flight).",
            requests.max_concurrent,
        ),
        (
            "kvgate_emulator_requests",
            "counter",
            "Completion requests accepted by this emulated worker.",
            requests.requests_total,
        ),
    ]
    info = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(config)
    )
    info.add_metric([str(v) for v in config.values()], 1.0)
    families: list[Metric] = [info]
    for name, kind, help_text, value in simple:
        family_of = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = family_of(name, help_text, labels=list(lab))
        family.add_metric(list(lab.values()), float(value))
        families.append(family)
    families.append(
        _histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            requests.ttft,
            lab,
        )
    )
    families.append(
        _histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            requests.e2e,
            lab,
        )
    )
    return text_of(families)


# --- parsing (tests, and anything that wants to read a scrape without prometheus_client) ---


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_prometheus_text(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (prometheus-client's parser); ValueError if malformed."""
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def sample_value(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """The value of the one sample called `name` whose labels include `labels`; KeyError if none."""
    for sample in samples:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise KeyError(f"no sample {name} with labels {labels}")
