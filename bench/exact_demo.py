"""Live comparison of the two prefix-index modes: approximate (text chunks, gateway-written) against
exact (token blocks from the workers' /tokenize, agent-written from KV events).

Same stack and scenario as `kvgate demo` (bench/demo.py): embedded Redis, 4 emulated vLLM workers
with 2,000 KV blocks each, the tenant-system-prompts scenario (12 × 6,000-token system prompts: cache
pressure 2.25× one worker's KV). The prompts are sized in the workers' own tokens (with
`--local-tokenizer`, the toy BPE makes a token of fewer characters than the fake tokenizer's 4), and the
printed pressure counts them.
Approximate run: agents without KV events, gateway in approximate mode. Exact run: agents restarted
with `--kv-events`, a new gateway with `prefix_mode = "exact"`. `--order` sets which runs first
(default approximate); worker caches are reset before each run. `--decision-log DIR` keeps each
mode's decision records (DIR/decisions-MODE.jsonl) for a request-by-request comparison, and prints the
paired TTFT delta against approximate mode (the median over the requests of the difference; each request
has its own x-request-id, the same in every mode).
`--order` may add `approximate+events`: the approximate gateway with agents following the KV events
(what the event pipeline costs without exact routing). Prints TTFT p50/p99, the workers' own
prefix-cache hit rate, the exact run's /tokenize cost and fallbacks (from the gateway's /metrics), the
workers' own mean TTFT, the gateway's hot-path CPU per stage and the CPU of each kind of process.

    python -m bench.exact_demo [--requests 240] [--rate 8] [--order exact,approximate] [--decision-log DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tokenizers import Tokenizer

from bench import toy_model
from bench.demo import (
    NUM_GPU_BLOCKS,
    PROFILE,
    WORKERS,
    RunSummary,
    prefix_cache_counters,
    reset_caches,
    summarize,
    worker_metric_sums,
)
from bench.emulator import tokenizer as fake
from bench.live_scenarios import TenantPromptsScenario
from bench.loadgen import run_open_loop
from bench.stack import Stack
from policy.prefix import CHARS_PER_TOKEN
from store.redis_server import free_port


def wait_routable(gateway: str, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{gateway}/readyz", timeout=2) as resp:
                if json.loads(resp.read()).get("live_workers") == count:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{gateway} did not see {count} live workers in {timeout_s} s")


def gateway_metrics(metrics_url: str) -> dict[str, float]:
    """Sums of the exact-mode samples in the gateway's /metrics (on its metrics port)."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(("kvgate_tokenize", "kvgate_prefix_fallbacks", "kvgate_routing_decisions")):
            key = name + ("{kind=hit}" if 'kind="hit"' in line else "")
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        elif name == "kvgate_hot_path_cpu_seconds_sum":  # the loop's CPU per stage, in ms per request
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            out[f"cpu_ms{{{stage}}}"] = out.get(f"cpu_ms{{{stage}}}", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def worker_ttft(worker_urls: list[str]) -> tuple[float, float]:
    """Sum and count of the workers' own vllm:time_to_first_token_seconds (from the request's arrival
    at the worker, its own tokenization excluded)."""
    total, count = worker_metric_sums(
        worker_urls, "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"
    )
    return total, count


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds (user + system, /proc) so far of the stack's live processes, by role: gateway, agent,
    worker, redis. Empty where /proc is not there."""
    pids = [(p.name.split("-", 1)[0], p.proc.pid) for p in stack.processes if p.proc.poll() is None]
    if stack.redis is not None and stack.redis.pid is not None:
        pids.append(("redis", stack.redis.pid))
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, float] = {}
    for role, pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


KV_TOKENS = NUM_GPU_BLOCKS * 16  # one worker's KV (16-token blocks)
# approximate+events: the approximate gateway beside agents that follow the KV events (what the events
# alone cost, without exact routing)
MODES = ("approximate", "exact", "approximate+events")


def token_counter(tokenizer: Path | None) -> Callable[[str], int]:
    """Tokens of a text in the workers' tokenizer: the toy BPE of `tokenizer`'s model directory, else
    the emulator's fake one (4 characters per token)."""
    if tokenizer is None:
        return fake.count_tokens
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def run(
    stack: Stack,
    mode: str,
    scenario: TenantPromptsScenario,
    work_dir: Path,
    tokenizer: Path | None = None,
    decision_log: Path | None = None,
) -> tuple[RunSummary, dict[str, float]]:
    config = work_dir / f"gateway-{mode}.toml"
    local = f'tokenizer = "{tokenizer}"\n' if tokenizer is not None and mode == "exact" else ""
    log = f'\n[decision_log]\nfile = "{decision_log / f"decisions-{mode}.jsonl"}"\n' if decision_log else ""
    prefix_mode = "exact" if mode == "exact" else "approximate"
    config.write_text(
        f'[routing]\nprefix_mode = "{prefix_mode}"\n\n[models."{scenario.model}"]\n{local}{log}'
    )
    gateway = stack.start_gateway(mode, config=config)
    wait_routable(gateway, WORKERS)
    reset_caches(stack.worker_urls)
    hits0, queries0 = prefix_cache_counters(stack.worker_urls)
    ttft0 = worker_ttft(stack.worker_urls)
    cpu0 = cpu_seconds(stack)
    started = time.perf_counter()
    # an x-request-id per request: the decision records of two modes pair up request by request
    requests = [
        replace(q, headers={**q.headers, "x-request-id": f"demo-{i}"}) for i, q in enumerate(scenario.build())
    ]
    results = asyncio.run(run_open_loop(gateway, requests))
    wall_s = time.perf_counter() - started
    hits1, queries1 = prefix_cache_counters(stack.worker_urls)
    ttft1 = worker_ttft(stack.worker_urls)
    cpu1 = cpu_seconds(stack)
    extra = gateway_metrics(stack.metrics_urls[gateway])
    for key in [k for k in extra if k.startswith("cpu_ms")]:
        extra[key] = round(extra[key] * 1000 / len(requests), 3)
    for role, used in cpu1.items():  # CPU the run cost each kind of process (ms per request)
        extra[f"proc_cpu_ms{{{role}}}"] = round((used - cpu0.get(role, 0.0)) * 1000 / len(requests), 2)
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    extra["client_ttft_mean_ms"] = round(sum(ttfts) * 1000 / max(1, len(ttfts)), 2)
    extra["worker_ttft_mean_ms"] = round((ttft1[0] - ttft0[0]) * 1000 / max(1.0, ttft1[1] - ttft0[1]), 2)
    # spread: distinct (system prompt, worker) pairs the requests used (12 = each tenant on one worker)
    extra["placements"] = len(
        {(json.dumps(q.body["messages"][0]), r.worker) for q, r in zip(requests, results, strict=True)}  # type: ignore[index]
    )
    stack.stop_process(f"gateway-{mode}")
    return summarize(mode, results, wall_s, hits1 - hits0, queries1 - queries0), extra


def paired_ttft_delta(log_dir: Path, mode: str, base: str = "approximate") -> tuple[float, int] | None:
    """(median over the requests both runs served of `mode`'s TTFT − `base`'s, in ms; that count) from
    the decision logs in `log_dir`: each request carries the same x-request-id in every mode (the open-
    loop schedule is the same), so a request's two records pair up. None if a log is missing."""
    runs = []
    for m in (mode, base):
        path = log_dir / f"decisions-{m}.jsonl"
        if not path.exists():
            return None
        records = (json.loads(line) for line in path.read_text().splitlines() if line)
        runs.append({r["client_request_id"]: r["ttft_ms"] for r in records if "ttft_ms" in r})
    ours, theirs = runs
    deltas = [ours[k] - theirs[k] for k in ours.keys() & theirs.keys()]
    return (statistics.median(deltas), len(deltas)) if deltas else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.exact_demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (open loop)")
    parser.add_argument("--logs", type=Path, help="keep process logs here (default: a temporary directory)")
    parser.add_argument(
        "--local-tokenizer",
        action="store_true",
        help="workers and the exact-mode gateway load bench/toy_model.py's model directory (real BPE and "
        "Llama 3 template): the gateway tokenizes itself, no /tokenize round trip",
    )
    parser.add_argument(
        "--order", default="approximate,exact", help="the modes, run in this order (comma-separated)"
    )
    parser.add_argument(
        "--decision-log", type=Path, help="write each mode's decision records to DIR/decisions-MODE.jsonl"
    )
    args = parser.parse_args(argv)
    if any(m not in MODES for m in args.order.split(",")):
        parser.error(f"--order: modes are {', '.join(MODES)}, not {args.order!r}")
    if args.decision_log:
        args.decision_log.mkdir(parents=True, exist_ok=True)
    runs = []
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-exact-") as tmp,
        Stack(log_dir=args.logs or Path(tmp)) as stack,
    ):
        stack.start_redis()
        tokenizer = toy_model.build(Path(tmp) / "model") if args.local_tokenizer else None
        count = token_counter(tokenizer)
        # the prompts in the workers' own tokens, so the printed working set is what their KV holds
        scenario = TenantPromptsScenario(requests=args.requests, rate_rps=args.rate).sized_for(count)
        endpoints = {}
        for i in range(WORKERS):
            wid, endpoints[f"w{i}"] = f"w{i}", f"tcp://127.0.0.1:{free_port()}"
            url = stack.start_worker(
                wid, model=scenario.model, profile=PROFILE, time_scale=1.0,
                extra=["--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--kv-events-endpoint", endpoints[wid],
                       *(["--tokenizer", str(tokenizer)] if tokenizer else [])],
            )  # fmt: skip
        for mode in args.order.split(","):
            for i, url in enumerate(stack.worker_urls):  # agents again: following the KV events in exact mode
                stack.stop_process(f"agent-w{i}")
                kv = ["--kv-events", endpoints[f"w{i}"]] if mode != "approximate" else []
                stack.start_agent(f"w{i}", url, model=scenario.model, extra=kv)
            print(f"{mode} run ...", file=sys.stderr)
            local = tokenizer if mode == "exact" else None
            runs.append(run(stack, mode, scenario, stack.log_dir, local, args.decision_log))
    working_set = scenario.working_set_tokens(count)
    estimate = sum(len(p) for p in scenario.system_prompts()) / CHARS_PER_TOKEN
    tokens, each = "toy BPE" if tokenizer else "fake tokenizer", working_set / scenario.tenants
    print(
        f"\n{scenario.tenants} tenants × {each:.0f}-token system prompts ({tokens}: "
        f"{scenario.chars_per_token:.2f} characters per token; approximate mode's estimate "
        f"{estimate / scenario.tenants:.0f}), {scenario.requests} requests at {scenario.rate_rps}/s, "
        f"{WORKERS} workers; cache pressure {working_set / KV_TOKENS:.2f}× one worker, "
        f"{working_set / (WORKERS * KV_TOKENS):.2f}× the cluster"
    )
    print(
        f"{'mode':<12} {'TTFT p50':>10} {'TTFT p99':>10} {'hit rate':>9} {'req/s':>7} {'errors':>6}  gateway"
    )
    for r, extra in runs:
        print(f"{r.policy:<12} {r.ttft_p50 * 1000:>8.1f}ms {r.ttft_p99 * 1000:>8.1f}ms {r.hit_rate:>9.1%} "
              f"{r.throughput_rps:>7.2f} {r.errors:>6}  {json.dumps(extra, sort_keys=True)}")  # fmt: skip
    for mode in [m for m in args.order.split(",") if m != "approximate"] if args.decision_log else ():
        paired = paired_ttft_delta(args.decision_log, mode)
        if paired is not None:
            print(f"paired TTFT delta {mode} − approximate: median {paired[0]:+.2f} ms, {paired[1]} requests")
    return 0 if all(r.errors == 0 for r, _ in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
