"""`kvgate demo`: the whole product on one machine, kvgate routing against round-robin.

Starts an embedded Redis, 4 emulated vLLM workers with their agents, and the gateway; replays the
tenant-system-prompts scenario (bench/live_scenarios.py) through the gateway once with kvgate's
routing and once with round-robin (worker caches reset in between), and prints TTFT p50/p99, the
prefix-cache hit rate from the workers' own counters, and throughput for both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.live_scenarios import TenantPromptsScenario
from bench.loadgen import LiveResult, percentile, run_open_loop
from bench.sim.profiles import load_profile
from bench.stack import Stack

WORKERS = 4
PROFILE = "h100-llama3.1-8b"
# 2,000 blocks × 16 tokens = 32k tokens of KV per worker: small enough that the 12 tenants'
# 6k-token prompts (72k tokens) do not fit in one worker but fit in the cluster (128k).
NUM_GPU_BLOCKS = 2000


@dataclass(frozen=True)
class RunSummary:
    policy: str
    ttft_p50: float
    ttft_p99: float
    hit_rate: float
    throughput_rps: float
    errors: int


def gateway_config(policy: str, model: str, on_worker_full: str = "reroute") -> str:
    return f'[routing]\npolicy = "{policy}"\n\n[models."{model}"]\non_worker_full = "{on_worker_full}"\n'


def worker_metric_sums(worker_urls: list[str], *names: str) -> list[float]:
    """Each named metric's value summed over every series of every worker's /metrics."""
    sums = dict.fromkeys(names, 0.0)
    for url in worker_urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in sums:
                sums[name] += float(line.rsplit(" ", 1)[1])
    return [sums[n] for n in names]


def prefix_cache_counters(worker_urls: list[str]) -> tuple[float, float]:
    """Sum of vllm:prefix_cache_hits_total and vllm:prefix_cache_queries_total over the workers."""
    hits, queries = worker_metric_sums(
        worker_urls, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    )
    return hits, queries


def reset_caches(worker_urls: list[str]) -> None:
    for url in worker_urls:
        req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST", data=b"")
        urllib.request.urlopen(req, timeout=5).close()


def summarize(
    policy: str, results: list[LiveResult], wall_s: float, hits: float, queries: float
) -> RunSummary:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return RunSummary(
        policy=policy,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        hit_rate=hits / queries if queries else 0.0,
        throughput_rps=len(ok) / wall_s if wall_s > 0 else 0.0,
        errors=len(results) - len(ok),
    )


def run_policy(
    stack: Stack,
    policy: str,
    scenario: TenantPromptsScenario,
    work_dir: Path,
    on_worker_full: str = "reroute",
    decisions: Path | None = None,
) -> RunSummary:
    config = work_dir / f"gateway-{policy}.toml"
    toml = gateway_config(policy, scenario.model, on_worker_full)
    if decisions is not None:  # the decision log of this run, for kvgate bench replay
        toml += f'\n[decision_log]\nfile = "{decisions.resolve()}"\n'
    config.write_text(toml)
    gateway = stack.start_gateway(policy, config=config)
    reset_caches(stack.worker_urls)
    hits0, queries0 = prefix_cache_counters(stack.worker_urls)
    started = time.perf_counter()
    results = asyncio.run(run_open_loop(gateway, scenario.build()))
    wall_s = time.perf_counter() - started
    hits1, queries1 = prefix_cache_counters(stack.worker_urls)
    stack.stop_process(f"gateway-{policy}")
    return summarize(policy, results, wall_s, hits1 - hits0, queries1 - queries0)


def print_table(runs: list[RunSummary], scenario: TenantPromptsScenario) -> None:
    pressure = scenario.working_set_tokens() / (NUM_GPU_BLOCKS * 16)
    print(
        f"\nscenario: {scenario.tenants} tenants × {scenario.system_tokens}-token system prompts, "
        f"{scenario.requests} requests at {scenario.rate_rps}/s, {WORKERS} workers; "
        f"cache pressure {pressure:.2f}× one worker's KV"
    )
    print(f"{'policy':<12} {'TTFT p50':>10} {'TTFT p99':>10} {'hit rate':>9} {'req/s':>7} {'errors':>6}")
    for r in runs:
        print(
            f"{r.policy:<12} {r.ttft_p50 * 1000:>8.1f}ms {r.ttft_p99 * 1000:>8.1f}ms "
            f"{r.hit_rate:>9.1%} {r.throughput_rps:>7.2f} {r.errors:>6}"
        )
    if len(runs) == 2 and runs[0].ttft_p50 > 0:
        print(f"\nTTFT p50: kvgate is {runs[1].ttft_p50 / runs[0].ttft_p50:.1f}× faster than round-robin")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate demo", description=__doc__)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (open loop)")
    parser.add_argument(
        "--decisions", type=Path, help="write the kvgate run's decision log here (for kvgate bench replay)"
    )
    parser.add_argument("--logs", type=Path, help="keep process logs here (default: a temporary directory)")
    parser.add_argument(
        "--max-concurrency", type=int, default=0,
        help="each worker's max_concurrency as its agent registers it (0: the engine's max_num_seqs)",
    )  # fmt: skip
    parser.add_argument(
        "--on-worker-full", choices=("reroute", "wait"), default="reroute",
        help="two-step admission when the chosen worker is full (docs/ADMISSION.md)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    max_seqs = args.max_concurrency or load_profile(PROFILE).max_num_seqs
    scenario = TenantPromptsScenario(requests=args.requests, rate_rps=args.rate)
    if args.decisions is not None:
        args.decisions.unlink(missing_ok=True)  # the file sink appends
    with tempfile.TemporaryDirectory(prefix="kvgate-demo-") as tmp:
        work_dir = args.logs or Path(tmp)
        with Stack(log_dir=work_dir) as stack:
            print("starting embedded Redis, 4 emulated workers with agents ...", file=sys.stderr)
            stack.start_redis()
            for i in range(WORKERS):
                worker_id = f"w{i}"
                url = stack.start_worker(
                    worker_id, model=scenario.model, profile=PROFILE, time_scale=1.0,
                    extra=["--num-gpu-blocks", str(NUM_GPU_BLOCKS)],
                )  # fmt: skip
                # the agent registers the worker's concurrency: two-step admission checks it
                stack.start_agent(
                    worker_id, url, model=scenario.model, extra=["--max-concurrency", str(max_seqs)]
                )
            runs = []
            for policy in ("kvgate", "round_robin"):
                print(f"replaying {scenario.requests} requests with {policy} routing ...", file=sys.stderr)
                decisions = args.decisions if policy == "kvgate" else None
                runs.append(run_policy(stack, policy, scenario, work_dir, args.on_worker_full, decisions))
    runs.sort(key=lambda r: r.policy)  # kvgate, round_robin
    print_table(runs, scenario)
    if args.json:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs]}, indent=2))
    return 0 if all(r.errors == 0 for r in runs) else 1
