"""The agent's and the emulated worker's /metrics keep main's names, kinds and labels.

Both are written by prometheus-client now (runtime/exposition.py); the pinned lists are what the
hand-written exposition before it exported, so a rename, a lost label or a changed kind fails here.
The emulator's samples must also keep their values (dashboards and the agent's scraper read them).
"""

from __future__ import annotations

import re

import aiohttp
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from agent.app import WorkerAgent
from agent.config import AgentConfig
from bench.emulator.metrics import EngineSnapshot, RequestMetrics, render

AGENT_COUNTERS = [
    "cache_resets", "heartbeats", "kv_batches", "kv_decode_errors", "kv_events", "kv_missed_batches",
    "kv_replay_failures", "kv_replays", "kv_seq_gaps", "kv_tail_probe_recoveries", "kv_unknown_parent_blocks",
    "kv_write_errors",
    "probe_errors", "redis_errors", "registrations", "scrape_errors", "worker_restarts",
]  # fmt: skip
AGENT_GAUGES = [
    "draining", "kv_last_recovery_seconds", "lease_renewing", "worker_kv_usage", "worker_running",
    "worker_waiting",
]  # fmt: skip

VLLM = ("engine", "model_name")
EMULATOR = [  # (sample, label names), as main's hand-written render() exported them
    ("kvgate_emulator_max_concurrent_requests", VLLM),
    ("kvgate_emulator_requests_total", VLLM),
    ("vllm:cache_config_info", ("block_size", "cache_dtype", "enable_prefix_caching", "engine",
                                "gpu_memory_utilization", "num_cpu_blocks", "num_gpu_blocks")),
    ("vllm:e2e_request_latency_seconds_bucket", ("engine", "le", "model_name")),
    ("vllm:e2e_request_latency_seconds_count", VLLM),
    ("vllm:e2e_request_latency_seconds_sum", VLLM),
    ("vllm:generation_tokens_total", VLLM),
    ("vllm:kv_cache_usage_perc", VLLM),
    ("vllm:num_preemptions_total", VLLM),
    ("vllm:num_requests_running", VLLM),
    ("vllm:num_requests_waiting", VLLM),
    ("vllm:prefix_cache_hits_total", VLLM),
    ("vllm:prefix_cache_queries_total", VLLM),
    ("vllm:prompt_tokens_total", VLLM),
    ("vllm:time_to_first_token_seconds_bucket", ("engine", "le", "model_name")),
    ("vllm:time_to_first_token_seconds_count", VLLM),
    ("vllm:time_to_first_token_seconds_sum", VLLM),
]  # fmt: skip


def samples(text: str) -> dict[tuple[str, tuple[str, ...]], list[float]]:
    out: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault((s.name, tuple(sorted(s.labels))), []).append(s.value)
    return out


async def test_the_agents_metric_names_kinds_and_labels_are_unchanged() -> None:
    config = AgentConfig(worker_url="http://127.0.0.1:9", redis_url="redis://127.0.0.1:9", worker_id="w1")
    async with aiohttp.ClientSession() as session:
        agent = WorkerAgent(config, aioredis.Redis(), session)
        agent.counts["heartbeats"] = 3
        text = agent.metrics_text()
    names = [f"kvgate_agent_{n}_total" for n in AGENT_COUNTERS] + [f"kvgate_agent_{n}" for n in AGENT_GAUGES]
    assert sorted(samples(text)) == sorted((n, ("worker",)) for n in names)
    kinds = dict(re.findall(r"# TYPE (\S+) (\S+)", text))
    assert kinds == {n: "counter" if n.endswith("_total") else "gauge" for n in names}
    assert 'kvgate_agent_heartbeats_total{worker="w1"} 3.0' in text


def test_the_emulators_metric_names_labels_and_values_are_unchanged() -> None:
    requests = RequestMetrics()
    requests.request_started(100)
    requests.request_ended(7)
    requests.ttft.observe(0.03)
    requests.e2e.observe(1.2)
    engine = EngineSnapshot(
        running=2, waiting=1, kv_usage=0.25, prefix_cache_queries=90, prefix_cache_hits=40,
        num_preemptions=3, block_size=16, num_gpu_blocks=1000,
    )  # fmt: skip
    found = samples(render("m-1", requests, engine))
    assert sorted(found) == sorted(EMULATOR)
    assert found[("vllm:prefix_cache_hits_total", VLLM)] == [40.0]
    assert found[("vllm:prompt_tokens_total", VLLM)] == [100.0]
    assert found[("vllm:time_to_first_token_seconds_count", VLLM)] == [1.0]
    buckets = found[("vllm:time_to_first_token_seconds_bucket", ("engine", "le", "model_name"))]
    assert buckets == sorted(buckets) and buckets[-1] == 1.0 and buckets.count(0.0) == 4  # 0.03 > 0.02
