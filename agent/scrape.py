"""Read a worker's load from its Prometheus `/metrics` text (vLLM or SGLang names).

`parse_prometheus` reads the text exposition format with prometheus-client's parser (the format's
reference implementation, which vLLM's and SGLang's exporters write). `extract_load`
maps the engine's metric names to one `WorkerLoad`: gauges are summed over label sets (several
engines or data-parallel ranks behind one endpoint), KV usage is the mean, capacity comes from
`cache_config_info` labels. Histograms (`_bucket`/`_sum`/`_count`) are parsed but not used. The
counters kept in `WorkerLoad.counters` let the agent detect a worker restart (a counter that goes
backwards).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


class MetricsParseError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, in order (prometheus-client's own parser).

    Raises MetricsParseError naming the first line that does not parse on its own."""
    try:
        return [
            Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except (ValueError, TypeError, IndexError, KeyError) as e:
        for line_no, raw in enumerate(text.splitlines(), 1):
            if raw.strip() and not raw.lstrip().startswith("#"):
                try:
                    list(text_string_to_metric_families(raw.strip() + "\n"))
                except (ValueError, TypeError, IndexError, KeyError):
                    raise MetricsParseError(f"line {line_no}: {raw!r} does not parse") from e
        raise MetricsParseError(f"not Prometheus text: {e}") from e


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What the agent reports about one worker after a scrape."""

    engine: str  # "vllm" | "sglang" | "unknown"
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    block_size: int = 0
    num_gpu_blocks: int = 0
    capacity_tokens: int = 0
    # monotonic counters of the worker process (restart detection): name -> value summed over labels
    counters: Mapping[str, float] = field(default_factory=dict)
    cache_hit_tokens: float = 0.0
    cache_query_tokens: float = 0.0

    @property
    def cache_config(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_gpu_blocks, self.capacity_tokens)


def _sum(samples: Iterable[Sample], *names: str) -> float | None:
    """Sum of the first of `names` that has samples (later names are legacy aliases)."""
    for name in names:
        values = [s.value for s in samples if s.name == name and not math.isnan(s.value)]
        if values:
            return sum(values)
    return None


def _mean(samples: Iterable[Sample], *names: str) -> float | None:
    for name in names:
        values = [s.value for s in samples if s.name == name and not math.isnan(s.value)]
        if values:
            return sum(values) / len(values)
    return None


def _label_int(labels: Mapping[str, str], *names: str) -> int:
    for name in names:
        try:
            return int(float(labels[name]))
        except (KeyError, ValueError):
            continue
    return 0


_VLLM_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
)
_SGLANG_COUNTERS = (
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:num_requests_total",
)


def extract_load(samples: list[Sample]) -> WorkerLoad:
    """The worker's load from parsed samples; engine detected from the metric-name prefix."""
    names = {s.name for s in samples}
    if any(n.startswith("vllm:") for n in names):
        return _vllm(samples)
    if any(n.startswith("sglang:") for n in names):
        return _sglang(samples)
    return WorkerLoad(engine="unknown")


def _counters(samples: list[Sample], names: Iterable[str]) -> dict[str, float]:
    return {n: v for n in names if (v := _sum(samples, n)) is not None}


def _vllm(samples: list[Sample]) -> WorkerLoad:
    block_size = num_blocks = 0
    for s in samples:
        if s.name == "vllm:cache_config_info":
            block_size = block_size or _label_int(s.labels, "block_size")
            num_blocks += _label_int(s.labels, "num_gpu_blocks")  # one sample per engine: capacities add up
    return WorkerLoad(
        engine="vllm",
        running=int(_sum(samples, "vllm:num_requests_running") or 0),
        waiting=int(_sum(samples, "vllm:num_requests_waiting") or 0),
        kv_usage=_mean(samples, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc") or 0.0,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        capacity_tokens=block_size * num_blocks,
        counters=_counters(samples, _VLLM_COUNTERS),
        cache_hit_tokens=_sum(samples, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
        or 0.0,
        cache_query_tokens=_sum(
            samples, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"
        )
        or 0.0,
    )


def _sglang(samples: list[Sample]) -> WorkerLoad:
    page_size = num_pages = 0
    for s in samples:
        if s.name == "sglang:cache_config_info":
            page_size = page_size or _label_int(s.labels, "page_size", "block_size")
            num_pages += _label_int(s.labels, "num_pages", "num_gpu_blocks")
    capacity = int(_sum(samples, "sglang:max_total_num_tokens") or 0) or page_size * num_pages
    return WorkerLoad(
        engine="sglang",
        running=int(_sum(samples, "sglang:num_running_reqs") or 0),
        waiting=int(_sum(samples, "sglang:num_queue_reqs") or 0),
        kv_usage=_mean(samples, "sglang:token_usage") or 0.0,
        block_size=page_size,
        num_gpu_blocks=num_pages or (capacity // page_size if page_size else 0),
        capacity_tokens=capacity,
        counters=_counters(samples, _SGLANG_COUNTERS),
    )


def counters_went_backwards(before: Mapping[str, float], after: Mapping[str, float]) -> list[str]:
    """Names of counters present in both scrapes whose value decreased (the process restarted)."""
    return sorted(n for n, v in after.items() if n in before and v < before[n])
