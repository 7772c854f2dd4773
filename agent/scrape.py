"""Read a worker's load from its Prometheus `/metrics` text (vLLM or SGLang names).

`parse_prometheus` is a small, complete parser of the text exposition format (comments, HELP/TYPE,
labels with escaped quotes/backslashes/newlines, NaN/±Inf, optional timestamps). `extract_load`
maps the engine's metric names to one `WorkerLoad`: gauges are summed over label sets (several
engines or data-parallel ranks behind one endpoint), KV usage is the mean, capacity comes from
`cache_config_info` labels. Histograms (`_bucket`/`_sum`/`_count`) are parsed but not used. The
counters kept in `WorkerLoad.counters` let the agent detect a worker restart (a counter that goes
backwards).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class MetricsParseError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
# fast path: one label `name="value"` (value without backslashes) and its separator
_SIMPLE_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"\s*(?:,|(?=\}))')


def _parse_value(text: str, line_no: int) -> float:
    special = {"nan": math.nan, "+inf": math.inf, "inf": math.inf, "-inf": -math.inf}
    lowered = text.lower()
    if lowered in special:
        return special[lowered]
    try:
        return float(text)
    except ValueError:
        raise MetricsParseError(f"line {line_no}: bad sample value {text!r}") from None


def _parse_labels(line: str, pos: int, line_no: int) -> tuple[dict[str, str], int]:
    """Labels from `line[pos]` == '{' to the closing '}'; returns them and the index after '}'."""
    labels: dict[str, str] = {}
    start = pos
    pos += 1
    while match := _SIMPLE_LABEL.match(line, pos):  # common case, ~10x faster than per character
        labels[match.group(1)] = match.group(2)
        pos = match.end()
    if line.startswith("}", pos):
        return labels, pos + 1
    labels, pos = {}, start + 1  # escapes or an error: parse character by character
    while True:
        while pos < len(line) and line[pos] in " \t,":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return labels, pos + 1
        match = _LABEL_NAME.match(line, pos)
        if not match:
            raise MetricsParseError(f"line {line_no}: bad label name at column {pos + 1}")
        name = match.group()
        pos = match.end()
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if line[pos : pos + 2] != '="':
            raise MetricsParseError(f'line {line_no}: expected =" after label {name}')
        pos += 2
        value: list[str] = []
        while True:
            if pos >= len(line):
                raise MetricsParseError(f"line {line_no}: unterminated value of label {name}")
            char = line[pos]
            if char == "\\" and pos + 1 < len(line):
                nxt = line[pos + 1]
                value.append(_ESCAPES.get(nxt, "\\" + nxt))
                pos += 2
            elif char == '"':
                pos += 1
                break
            else:
                value.append(char)
                pos += 1
        labels[name] = "".join(value)


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, in order. Raises MetricsParseError with the line."""
    samples = []
    for line_no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _NAME.match(line)
        if not match:
            raise MetricsParseError(f"line {line_no}: bad metric name in {raw!r}")
        name, pos = match.group(), match.end()
        labels: dict[str, str] = {}
        if pos < len(line) and line[pos] == "{":
            labels, pos = _parse_labels(line, pos, line_no)
        parts = line[pos:].split()
        if not parts or len(parts) > 2:
            raise MetricsParseError(f"line {line_no}: expected a value (and optional timestamp) in {raw!r}")
        samples.append(Sample(name, labels, _parse_value(parts[0], line_no)))
    return samples


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
