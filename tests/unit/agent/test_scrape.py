"""Prometheus text parsing and load extraction from vLLM and SGLang metric names."""

from __future__ import annotations

import math

import pytest

from agent.scrape import MetricsParseError, Sample, counters_went_backwards, extract_load, parse_prometheus

VLLM_TEXT = r"""
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 600.0
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 5000.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="1",num_gpu_blocks="1000"} 1.0
"""

VLLM_OLD_TEXT = """
vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
vllm:gpu_prefix_cache_hits_total{model_name="m"} 7
"""

SGLANG_TEXT = """
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",engine_type="unified",tp_rank="0"} 6.0
sglang:num_queue_reqs{model_name="qwen",engine_type="unified",tp_rank="0"} 2.0
sglang:token_usage{model_name="qwen",engine_type="unified",tp_rank="0"} 0.4
sglang:max_total_num_tokens{model_name="qwen",engine_type="unified",tp_rank="0"} 200000.0
sglang:cache_config_info{page_size="1",num_pages="200000",model_name="qwen"} 1
sglang:generation_tokens_total{model_name="qwen"} 900
"""


def test_parser_handles_comments_labels_escapes_specials_and_timestamps() -> None:
    text = "\n".join(
        [
            "# a comment",
            "# HELP x help with \\n escapes",
            'x{path="C:\\\\dir",quote="say \\"hi\\"",nl="a\\nb",} 1.5 1712345678000',
            "y NaN",
            "z +Inf",
            "w -Inf",
            "  indented 2e3  ",
            "empty{} 0",
        ]
    )
    samples = parse_prometheus(text)
    assert samples[0] == Sample("x", {"path": "C:\\dir", "quote": 'say "hi"', "nl": "a\nb"}, 1.5)
    assert math.isnan(samples[1].value)
    assert [s.value for s in samples[2:]] == [math.inf, -math.inf, 2000.0, 0.0]
    assert [s.name for s in samples] == ["x", "y", "z", "w", "indented", "empty"]


def test_label_value_may_contain_braces_commas_and_spaces() -> None:
    [sample] = parse_prometheus('m{a="x} ,y=\\"1\\"",b="2"} 3')
    assert sample.labels == {"a": 'x} ,y="1"', "b": "2"}
    [sample] = parse_prometheus('m{plain="ok", esc="q\\"x", brace="}"} 4')
    assert sample.labels == {"plain": "ok", "esc": 'q"x', "brace": "}"}


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("9bad 1", id="name starts with a digit"),
        pytest.param('m{a="1} 2', id="unterminated label value"),
        pytest.param("m{a=1} 2", id="unquoted label value"),
        pytest.param("m", id="no value"),
        pytest.param("m one", id="value not a number"),
        # "m 1 2 3" (extra fields) is not here: prometheus-client's parser, the reference, tolerates it
    ],
)
def test_parser_rejects_malformed_lines_with_line_number(text: str) -> None:
    with pytest.raises(MetricsParseError, match="line 2"):
        parse_prometheus("ok 1\n" + text)


def test_vllm_load_sums_engines_and_reads_cache_config() -> None:
    load = extract_load(parse_prometheus(VLLM_TEXT))
    assert (load.engine, load.running, load.waiting, load.kv_usage) == ("vllm", 5, 4, 0.375)
    assert (load.block_size, load.num_gpu_blocks, load.capacity_tokens) == (16, 2000, 32000)
    assert (load.cache_hit_tokens, load.cache_query_tokens) == (600.0, 1000.0)
    assert load.counters["vllm:prompt_tokens_total"] == 5000.0


def test_vllm_old_names_are_understood() -> None:
    load = extract_load(parse_prometheus(VLLM_OLD_TEXT))
    assert (load.running, load.kv_usage, load.cache_hit_tokens, load.capacity_tokens) == (1, 0.75, 7.0, 0)


def test_sglang_load() -> None:
    load = extract_load(parse_prometheus(SGLANG_TEXT))
    assert (load.engine, load.running, load.waiting, load.kv_usage) == ("sglang", 6, 2, 0.4)
    assert (load.block_size, load.num_gpu_blocks, load.capacity_tokens) == (1, 200000, 200000)
    assert load.counters == {"sglang:generation_tokens_total": 900.0}


def test_unknown_engine_gives_empty_load() -> None:
    assert extract_load(parse_prometheus("process_cpu_seconds_total 3")).engine == "unknown"


@pytest.mark.parametrize(
    ("before", "after", "backwards"),
    [
        pytest.param({"a": 5.0}, {"a": 6.0}, [], id="counter grew"),
        pytest.param({"a": 5.0, "b": 1.0}, {"a": 0.0, "b": 1.0}, ["a"], id="counter reset: restart"),
        pytest.param({"a": 5.0}, {"b": 0.0}, [], id="disjoint names: no evidence"),
    ],
)
def test_counters_went_backwards(
    before: dict[str, float], after: dict[str, float], backwards: list[str]
) -> None:
    assert counters_went_backwards(before, after) == backwards
