"""/metrics text: vLLM names and labels, cumulative histograms, and the parser that reads it back."""

from __future__ import annotations

import pytest

from bench.emulator.metrics import (
    EngineSnapshot,
    Histogram,
    RequestMetrics,
    parse_prometheus_text,
    render,
    sample_value,
)

ENGINE = EngineSnapshot(
    running=3,
    waiting=2,
    kv_usage=0.25,
    prefix_cache_queries=1000,
    prefix_cache_hits=640,
    num_preemptions=1,
    block_size=16,
    num_gpu_blocks=2000,
)
LABELS = {"model_name": "m-1", "engine": "0"}


def rendered() -> list:
    requests = RequestMetrics()
    for prompt in (100, 200, 300):
        requests.request_started(prompt)
    requests.request_ended(10)
    requests.ttft.observe(0.003)
    requests.ttft.observe(0.3)
    requests.e2e.observe(1.2)
    return parse_prometheus_text(render("m-1", requests, ENGINE))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("vllm:num_requests_running", 3, id="running"),
        pytest.param("vllm:num_requests_waiting", 2, id="waiting"),
        pytest.param("vllm:kv_cache_usage_perc", 0.25, id="kv usage"),
        pytest.param("vllm:prefix_cache_queries_total", 1000, id="queries"),
        pytest.param("vllm:prefix_cache_hits_total", 640, id="hits"),
        pytest.param("vllm:num_preemptions_total", 1, id="preemptions"),
        pytest.param("vllm:prompt_tokens_total", 600, id="prompt tokens"),
        pytest.param("vllm:generation_tokens_total", 10, id="generation tokens"),
        pytest.param("kvgate_emulator_max_concurrent_requests", 3, id="max concurrent"),
        pytest.param("kvgate_emulator_requests_total", 3, id="requests"),
        pytest.param("vllm:time_to_first_token_seconds_count", 2, id="ttft count"),
        pytest.param("vllm:e2e_request_latency_seconds_sum", 1.2, id="e2e sum"),
    ],
)
def test_each_metric_has_vllm_name_labels_and_value(name: str, value: float) -> None:
    assert sample_value(rendered(), name, **LABELS) == pytest.approx(value)


def test_cache_config_info_carries_block_size_and_blocks() -> None:
    samples = rendered()
    info = [s for s in samples if s.name == "vllm:cache_config_info"]
    assert len(info) == 1
    assert info[0].value == 1
    assert info[0].labels["block_size"] == "16"
    assert info[0].labels["num_gpu_blocks"] == "2000"


def test_histogram_buckets_are_cumulative_and_end_at_inf() -> None:
    buckets = [s for s in rendered() if s.name == "vllm:time_to_first_token_seconds_bucket"]
    by_le = {s.labels["le"]: s.value for s in buckets}
    assert by_le["0.001"] == 0
    assert by_le["0.005"] == 1
    assert by_le["0.25"] == 1
    assert by_le["0.5"] == 2
    assert by_le["+Inf"] == 2
    assert [s.value for s in buckets] == sorted(s.value for s in buckets)


def test_max_concurrent_is_a_high_water_mark() -> None:
    requests = RequestMetrics()
    requests.request_started(1)
    requests.request_started(1)
    requests.request_ended(0)
    requests.request_ended(0)
    requests.request_started(1)
    assert (requests.in_flight, requests.max_concurrent) == (1, 2)


def test_histogram_puts_a_value_on_a_bound_into_that_bucket() -> None:
    hist = Histogram((1.0, 2.0))
    for v in (1.0, 1.5, 3.0):
        hist.observe(v)
    assert hist.counts == [1, 1, 1]


@pytest.mark.parametrize(
    ("line", "name", "labels", "value"),
    [
        pytest.param("a 1", "a", {}, 1.0, id="no labels"),
        pytest.param("a{} 2.5", "a", {}, 2.5, id="empty labels"),
        pytest.param('a:b{x="1",y="two"} 3 1700000000', "a:b", {"x": "1", "y": "two"}, 3.0, id="timestamp"),
        pytest.param(
            r'a{x="q\"uote",y="back\\slash"} 4', "a", {"x": 'q"uote', "y": "back\\slash"}, 4.0, id="escapes"
        ),
        pytest.param('a{x="a,b"} +Inf', "a", {"x": "a,b"}, float("inf"), id="comma in value and inf"),
    ],
)
def test_parser_reads_samples(line: str, name: str, labels: dict, value: float) -> None:
    [sample] = parse_prometheus_text(f"# HELP a x\n# TYPE a gauge\n\n{line}\n")
    assert (sample.name, dict(sample.labels), sample.value) == (name, labels, value)


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("a{x=1} 1", id="unquoted label"),
        pytest.param("a", id="no value"),
        pytest.param("1a 2", id="bad name"),
        pytest.param('a{x="1" 2', id="unclosed braces"),
    ],
)
def test_parser_rejects_malformed_lines(line: str) -> None:
    with pytest.raises(ValueError):
        parse_prometheus_text(line)
