"""The churn scenario live (issue 13): approximate against exact prefix index on emulated workers.

The simulator's `churn` (bench/sim/scenarios.py) on 4 emulated vLLM workers instead of 8, by default with
its sizes: `--tenants` 400 system prompts (800 on 8 workers) of 4k-16k tokens (filler words 1900-7600:
the toy tokenizer makes about 2.1 tokens of one), Zipf s = 0.9, each request adding its own 100-800
tokens and asking for 100-400 output tokens, `--requests` 2000 (500 per worker, as 4000 on 8), KV pools of
the profile's 27,284 blocks; a fifth of the requests sent straight to one worker per tenant (clients that
bypass the gateway), and worker w0 restarted halfway through: its emulator process is killed (SIGKILL)
and started again on the same port, so its running requests fail, its whole KV cache is gone, its
Prometheus counters start over and its KV-event publisher starts again at sequence 0.

Session 8's default (24 tenants of 6.6k tokens on 1,500-block pools, 16 output tokens, 300 requests) is
`--tenants 24 --system-tokens 3000 --user-tokens 30-200 --output-tokens 16 --blocks 1500 --requests 300
--time-scale 4 --stream-interval-ms 20`: a prompt there is 28 % of a worker's KV (the simulator's: 2.3 %),
and on that plan the simulator itself has approximate ahead of exact (docs/BENCHMARKS.md, session 9).

`--sim` (or `--sim-only`, no live stack) also runs the simulator on this very plan (`sim_requests`: the
same arrivals, token ids as engine blocks, bypass traffic and restart) with the index models exact,
approx and oracle, 4 engines of `--blocks`: the live figures' simulated twins, and the oracle live lacks.

Offered load, as in the simulator: `--load L` is the fraction of the 4 workers' cold capacity, the rule
of bench/sim/load.py applied to this plan. W(request) is the engine model's cold prefill of the prompt
as the workers tokenize it (the toy model's chat template and tokenizer) plus its output tokens at the
reference decode cost; the arrivals are scaled so that sum(W) / (span x workers) = L. The emulator runs
that same engine model (bench/sim/engine.py, profile h100-llama3.1-8b with `--blocks`), so this is its
cold capacity, not an estimate from a different model. `--time-scale S` runs the emulated GPUs S times
slower than modelled (wall = S x model seconds) and the arrivals S times further apart, so the
gateway's own CPU on this small machine weighs 1/S as much; TTFTs are reported in model seconds
(wall / S), the simulator's unit. The workers flush decoded tokens every `--stream-interval-ms` (wall;
500 by default: TTFT does not wait for it, and fewer SSE chunks through the gateway spare the CPU).

Each pair runs approximate (agents without KV events, gateway `prefix_mode = "approximate"`) and exact
(agents with `--kv-events`, gateway `prefix_mode = "exact"` with the local tokenizer, bench/toy_model.py;
the workers load the same), `--first` first. Caches are reset before each run. Prints the routed
requests' TTFT p50/p90/p99 and errors, the bypass requests' errors, and the workers' own prefix-cache
hit rate over all traffic; the JSON adds per-worker p90 and the gateway's routing reasons.

    flock /tmp/kvgate-heavy.lock python -m bench.churn_live [--first exact] [--pairs 1] [--sim]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
import urllib.request
import zlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench import toy_model
from bench.demo import PROFILE, WORKERS, prefix_cache_counters, reset_caches
from bench.emulator import engine_tokenizer
from bench.emulator.tokenizer import full_block_keys
from bench.exact_demo import wait_routable
from bench.live_scenarios import filler_text
from bench.loadgen import LiveRequest, LiveResult, run_open_loop
from bench.sim.bounds import reusable_working_set_tokens
from bench.sim.cluster import simulate
from bench.sim.load import LoadPlan, scale_to_load
from bench.sim.policy_router import INDEX_MODELS, PolicyRouter
from bench.sim.profiles import load_profile, scaled
from bench.sim.types import SimRequest
from bench.stack import Stack
from bench.stats import percentile
from policy.config import RoutingConfig
from store.redis_server import free_port

MODEL = "demo-model"
BYPASS_SHARE = 0.2  # the simulator's churn: a fifth of the requests bypass the router


@dataclass(frozen=True)
class Plan:
    requests: list[tuple[LiveRequest, int | None]]  # (request, None: gateway | worker index: bypass)
    load: LoadPlan  # arrivals in model seconds: send_at_s = model arrival x time_scale
    input_tokens: list[int]
    time_scale: float
    pressure: float  # the tenants' system prompts (tokens, as the workers count them) / the pooled KV
    tokens: list[list[int]]  # each request's prompt as the workers tokenize it (chat template applied)

    @property
    def rate_model_rps(self) -> float:
        return (len(self.requests) - 1) / self.load.span_s

    @property
    def cold_capacity_rps(self) -> float:
        """Requests per model second the workers serve with no cache hits (sum W = workers x span)."""
        return self.rate_model_rps / self.load.load


@dataclass(frozen=True)
class Shape:
    """Request sizes, each drawn uniformly from (lo, hi): filler words of `filler_text` for the prompts
    (the toy tokenizer makes about 2.1 tokens of one), tokens for the output."""

    system: tuple[int, int] = (3000, 3000)  # a tenant's system prompt
    user: tuple[int, int] = (30, 200)  # each request's own question
    output: tuple[int, int] = (16, 16)  # max_tokens


def _draw(rng: random.Random, span: tuple[int, int]) -> int:
    return span[0] if span[0] == span[1] else rng.randint(*span)  # a fixed size draws nothing


def build(seed: int, requests: int, tenants: int, shape: Shape) -> list[tuple[LiveRequest, int | None]]:
    """The requests at unit rate (send_at_s in arbitrary units; `plan` rescales them to the load)."""
    rng = random.Random(seed)
    prompts = [
        f"You are assistant {t}. " + filler_text(rng, _draw(rng, shape.system)) for t in range(tenants)
    ]
    weights = [1.0 / (k + 1) ** 0.9 for k in range(tenants)]
    out: list[tuple[LiveRequest, int | None]] = []
    send_at = 0.0
    for i in range(requests):
        send_at += rng.expovariate(1.0)
        tenant = rng.choices(range(tenants), weights=weights)[0]
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": prompts[tenant]},
                {"role": "user", "content": f"Question {i}: " + filler_text(rng, rng.randint(*shape.user))},
            ],
            "max_tokens": _draw(rng, shape.output),
        }
        bypass = zlib.crc32(f"t{tenant}".encode()) % WORKERS if rng.random() < BYPASS_SHARE else None
        out.append((LiveRequest(send_at_s=send_at, body=body), bypass))
    return out


def plan(
    raw: list[tuple[LiveRequest, int | None]], tokenizer: Path, blocks: int, load: float, time_scale: float
) -> Plan:
    """Arrivals scaled to `load` of the workers' cold capacity by bench/sim/load.py's rule."""
    engine = engine_tokenizer.load(str(tokenizer))
    tokens = [engine.chat(req.body) for req, _ in raw]
    lengths = [len(t) for t in tokens]
    sim = [
        SimRequest(i, req.send_at_s, n, int(req.body["max_tokens"]), (), ())  # type: ignore[call-overload]
        for i, ((req, _), n) in enumerate(zip(raw, lengths, strict=True))
    ]
    profile = scaled(load_profile(PROFILE), num_gpu_blocks=blocks)
    timed, load_plan = scale_to_load(profile, sim, WORKERS, load)
    requests = [
        (LiveRequest(send_at_s=s.arrival_s * time_scale, body=req.body), w)
        for s, (req, w) in zip(timed, raw, strict=True)
    ]
    systems = {str(req.body["messages"][0]["content"]) for req, _ in raw}  # type: ignore[index]
    pressure = sum(len(engine.text(t)) for t in systems) / (blocks * 16 * WORKERS)
    return Plan(requests, load_plan, lengths, time_scale, pressure, tokens)


def tenant_of(body: Mapping[str, object]) -> str:
    """The tenant name the simulator's churn uses (`t{k}`), from the system prompt `build` wrote."""
    system = str(body["messages"][0]["content"])  # type: ignore[index]
    return "t" + system.removeprefix("You are assistant ").split(".", 1)[0]


def sim_requests(p: Plan, blocks_per_block: int = 16) -> list[SimRequest]:
    """The live plan as the simulator's churn requests: the same arrivals (model seconds), token counts,
    output tokens and engine blocks (the emulator's chained keys of the same token ids; a trailing
    partial block gets an id no other request shares, as the emulator's does), the same requests
    bypassing (to the same worker: the simulator's crc32(tenant) % workers is `build`'s rule) and w0
    restarted just before the middle request, as `_drive` does."""
    out = []
    fresh = itertools.count(1 << 62)
    middle = len(p.requests) // 2
    for i, ((req, w), toks) in enumerate(zip(p.requests, p.tokens, strict=True)):
        keys = full_block_keys(toks, blocks_per_block)
        sizes = [blocks_per_block] * len(keys)
        if len(toks) % blocks_per_block:
            keys.append(next(fresh))
            sizes.append(len(toks) % blocks_per_block)
        tenant = tenant_of(req.body)
        assert w is None or w == zlib.crc32(tenant.encode()) % WORKERS
        out.append(
            SimRequest(
                i, req.send_at_s / p.time_scale, len(toks), int(req.body["max_tokens"]),  # type: ignore[call-overload]
                tuple(keys), tuple(sizes), tenant=tenant, bypass=w is not None,
                restart_before=("w0",) if i == middle else (),
            )
        )  # fmt: skip
    return out


def simulate_plan(
    p: Plan, blocks: int, index: str, *, event_delay_s: float = 0.05, seed: int = 1
) -> dict[str, float]:
    """kvgate's policy with index model `index` on the live plan in the simulator (4 engines of `blocks`
    blocks): the worker hit over all traffic and the routed requests' TTFT percentiles, as `run` reports."""
    reqs = sim_requests(p)
    profile = scaled(load_profile(PROFILE), num_gpu_blocks=blocks)
    router = PolicyRouter(
        "kvgate", RoutingConfig(policy="kvgate"), seed, index=index, event_delay_s=event_delay_s
    )
    result = simulate(reqs, router, profile, WORKERS)
    by_id = {r.id: r for r in reqs}
    routed = sorted(
        r.first_token_s - r.arrival_s
        for r in result.records
        if r.first_token_s is not None and not by_id[r.id].bypass
    )
    hits, queries = sum(result.prefix_cache_hits.values()), sum(result.prefix_cache_queries.values())
    return {
        "hit": hits / max(1, queries),
        "p50": percentile(routed, 50),
        "p90": percentile(routed, 90),
        "p99": percentile(routed, 99),
    }


async def _drive(
    stack: Stack, gateway: str, p: Plan
) -> tuple[list[LiveResult], list[LiveResult], float, float]:
    """(routed results, bypass results, w0's hits and queries just before its restart)."""
    urls = stack.worker_urls
    restart_at_s = p.requests[len(p.requests) // 2][0].send_at_s
    before = (0.0, 0.0)

    async def restart() -> None:
        nonlocal before
        await asyncio.sleep(restart_at_s)
        before = await asyncio.to_thread(prefix_cache_counters, urls[:1])
        await asyncio.to_thread(stack.restart, "worker-w0", kill=True, ready_url=f"{urls[0]}/health")
        print(f"  w0 restarted at {restart_at_s:.1f} s", file=sys.stderr)

    routed = [r for r, w in p.requests if w is None]
    direct = [run_open_loop(urls[w], [r for r, x in p.requests if x == w]) for w in range(len(urls))]
    results, bypass, _ = await asyncio.gather(
        run_open_loop(gateway, routed), asyncio.gather(*direct), restart()
    )
    return results, [r for rs in bypass for r in rs], before[0], before[1]


GATEWAY_SUMS = (
    "kvgate_routing_reasons_total",
    "kvgate_tokenize_seconds_sum",
    "kvgate_tokenize_seconds_count",
    "kvgate_admission_wait_seconds_sum",
    "kvgate_admission_wait_seconds_count",
    "kvgate_hot_path_cpu_seconds_sum",
    "kvgate_hot_path_cpu_seconds_count",
    "kvgate_prefix_fallbacks_total",
)


def gateway_sums(metrics_url: str) -> dict[str, float]:
    """The gateway's own account of a run: routing reasons by label set, tokenize and admission time."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(GATEWAY_SUMS):
            series, _, value = line.rpartition(" ")
            out[series] = out.get(series, 0.0) + float(value)
    return out


def set_agents(stack: Stack, endpoints: dict[str, str], kv_events: bool) -> None:
    """New agents for the next run, on an empty Redis: the previous run's index entries, routing history
    and leases are gone, so each run starts as the first of a job does."""
    for i in range(len(stack.worker_urls)):
        stack.stop_process(f"agent-w{i}")
        stack.processes = [p for p in stack.processes if p.name != f"agent-w{i}"]
    client = redis.Redis.from_url(stack.redis_url)
    try:
        client.flushall()
    finally:
        client.close()
    for i, url in enumerate(stack.worker_urls):
        extra = ["--kv-events", endpoints[f"w{i}"]] if kv_events else []
        stack.start_agent(f"w{i}", url, model=MODEL, extra=extra)


def run(
    stack: Stack, mode: str, p: Plan, tokenizer: Path, endpoints: dict[str, str], tag: str
) -> dict[str, Any]:
    set_agents(stack, endpoints, kv_events=mode == "exact")
    config = stack.log_dir / f"gateway-{tag}.toml"
    local = f'tokenizer = "{tokenizer}"\n' if mode == "exact" else ""
    config.write_text(f'[routing]\nprefix_mode = "{mode}"\n\n[models."{MODEL}"]\n{local}')
    gateway = stack.start_gateway(tag, config=config)
    wait_routable(gateway, WORKERS)
    reset_caches(stack.worker_urls)
    time.sleep(1.0)  # the agents publish the cleared caches
    hits0, queries0 = prefix_cache_counters(stack.worker_urls)
    t0 = time.monotonic()
    results, bypass, w0_hits, w0_queries = asyncio.run(_drive(stack, gateway, p))
    wall = time.monotonic() - t0
    hits1, queries1 = prefix_cache_counters(stack.worker_urls)  # w0's counters started over at its restart
    gateway_metrics = gateway_sums(stack.metrics_urls[gateway])
    stack.stop_process(f"gateway-{tag}")
    s = p.time_scale
    ttfts = sorted(r.ttft_s / s for r in results if r.ok and r.ttft_s is not None)
    return {
        "hit": (hits1 - hits0 + w0_hits) / max(1.0, queries1 - queries0 + w0_queries),
        "p50": percentile(ttfts, 50),
        "p90": percentile(ttfts, 90),
        "p99": percentile(ttfts, 99),
        "errors": float(sum(not r.ok for r in results)),
        "routed": float(len(results)),
        "bypass_errors": float(sum(not r.ok for r in bypass)),
        "bypass": float(len(bypass)),
        "wall_s": wall,
        # the routed requests' own cached share (usage.prompt_tokens_details) and where they went
        "routed_hit": sum(r.cached_tokens for r in results) / max(1, sum(r.prompt_tokens for r in results)),
        "by_worker": dict(sorted(Counter(str(r.worker) for r in results).items())),
        "p90_by_worker": {
            w: percentile(
                sorted(r.ttft_s / s for r in results if r.ok and r.ttft_s is not None and r.worker == w), 90
            )
            for w in sorted({r.worker for r in results if r.ok and r.ttft_s is not None}, key=str)
        },
        "gateway": gateway_metrics,
        "error_kinds": dict(Counter(f"{r.status} {r.error}"[:80] for r in [*results, *bypass] if not r.ok)),
    }


def simulate_all(p: Plan, blocks: int) -> dict[str, dict[str, float]]:
    return {index: simulate_plan(p, blocks, index) for index in INDEX_MODELS}


def print_sim(p: Plan, args: argparse.Namespace, sim: dict[str, dict[str, float]]) -> None:
    reqs = sim_requests(p)
    reusable = reusable_working_set_tokens(reqs) / (args.blocks * 16 * WORKERS)
    print(
        f"simulator on the same plan ({len(reqs)} requests, {WORKERS} workers x {args.blocks} blocks, load "
        f"{args.load}; reusable working set {reusable:.2f}x the pooled KV):"
    )
    for index, m in sim.items():
        print(
            f"  {index:<7} hit {m['hit']:.1%}  p50 {m['p50']:.3f}s  p90 {m['p90']:.3f}s  p99 {m['p99']:.3f}s"
        )
    print(f"  approx / exact p90 = {sim['approx']['p90'] / max(1e-9, sim['exact']['p90']):.2f}x")


def span(text: str) -> tuple[int, int]:
    """ "N" or "LO-HI" (a command-line size)."""
    lo, _, hi = text.partition("-")
    bounds = (int(lo), int(hi or lo))
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI with 0 < LO <= HI, got {text!r}")
    return bounds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.churn_live", description=__doc__)
    # defaults: the simulator's churn (bench/sim/scenarios.py) on 4 workers, see the module docstring
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--load", type=float, default=1.6, help="fraction of the workers' cold capacity")
    parser.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per model second")
    parser.add_argument("--pairs", type=int, default=1, help="approximate/exact pairs")
    parser.add_argument(
        "--first", choices=("approximate", "exact"), default="approximate", help="each pair's first"
    )
    parser.add_argument("--tenants", type=int, default=400)
    parser.add_argument("--system-tokens", type=span, default=(1900, 7600), help="N or LO-HI filler words")
    parser.add_argument("--user-tokens", type=span, default=(48, 380), help="N or LO-HI filler words")
    parser.add_argument("--output-tokens", type=span, default=(100, 400), help="N or LO-HI tokens")
    parser.add_argument("--blocks", type=int, default=27284, help="KV blocks (16 tokens) per worker")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        default=20.0,
        help="the workers flush decoded tokens this often (wall)",
    )
    parser.add_argument("--json", type=Path, help="write the runs here")
    parser.add_argument("--logs", type=Path, help="keep process logs here (default: a temporary directory)")
    parser.add_argument("--sim", action="store_true", help="also the simulator's figures on this plan")
    parser.add_argument(
        "--sim-only", action="store_true", help="only the simulator's figures on this plan (no live stack)"
    )
    args = parser.parse_args(argv)
    shape = Shape(args.system_tokens, args.user_tokens, args.output_tokens)
    raw = build(args.seed, args.requests, args.tenants, shape)
    with tempfile.TemporaryDirectory(prefix="kvgate-churn-model-") as tmp:
        p = plan(raw, toy_model.build(Path(tmp) / "model"), args.blocks, args.load, args.time_scale)
    sim = simulate_all(p, args.blocks) if args.sim or args.sim_only else {}
    if args.sim_only:
        print_sim(p, args, sim)
        if args.json is not None:
            args.json.write_text(
                json.dumps({"args": vars(args) | {"json": str(args.json)}, "sim": sim}, indent=1)
            )
        return 0
    runs: list[dict[str, object]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-churn-") as tmp,
        Stack(log_dir=args.logs or Path(tmp)) as stack,
    ):
        tokenizer = toy_model.build(Path(tmp) / "model")  # the same model `plan` tokenized with
        wall_rps, mean_prompt = p.rate_model_rps / args.time_scale, sum(p.input_tokens) / len(p.input_tokens)
        print(
            f"cold capacity {p.cold_capacity_rps:.2f} req/s (model time, {WORKERS} workers); offering "
            f"{p.rate_model_rps:.2f} req/s = {args.load} x; wall {wall_rps:.2f} req/s at time scale "
            f"{args.time_scale}; mean prompt {mean_prompt:.0f} tokens; {p.pressure:.2f}x the pooled KV",
            file=sys.stderr,
        )
        stack.start_redis()
        endpoints = {}
        for i in range(WORKERS):
            wid, endpoints[f"w{i}"] = f"w{i}", f"tcp://127.0.0.1:{free_port()}"
            stack.start_worker(
                wid, model=MODEL, profile=PROFILE, time_scale=args.time_scale,
                extra=["--num-gpu-blocks", str(args.blocks), "--kv-events-endpoint", endpoints[wid],
                       "--tokenizer", str(tokenizer), "--stream-interval-ms", str(args.stream_interval_ms)],
            )  # fmt: skip
        order = ("approximate", "exact") if args.first == "approximate" else ("exact", "approximate")
        for k in range(args.pairs):
            for mode in order:
                print(f"{mode} run {k + 1} ...", file=sys.stderr)
                r = run(stack, mode, p, tokenizer, endpoints, f"{mode}-{k + 1}")
                runs.append({"mode": mode, "pair": k + 1, **r})
                print(f"  {json.dumps(r)}", file=sys.stderr)
    bypass = sum(w is not None for _, w in p.requests)
    print(
        f"\nchurn live: {args.tenants} tenants' system prompts, {p.pressure:.2f}× the pooled KV, "
        f"{args.requests} requests at {args.load} × cold capacity ({p.rate_model_rps:.2f} req/s model time, "
        f"time scale {args.time_scale}), {bypass} bypass the gateway, w0 restarted halfway"
    )
    print(f"{'mode':<12} {'pair':>4} {'hit':>6} {'p50':>8} {'p90':>8} {'p99':>8} errors bypass-errors")
    for r in runs:
        print(
            f"{r['mode']:<12} {r['pair']:>4} {r['hit']:>6.1%} {r['p50']:>7.3f}s {r['p90']:>7.3f}s "
            f"{r['p99']:>7.3f}s {r['errors']:>6.0f} {r['bypass_errors']:>6.0f}"
        )
    for k in range(args.pairs):
        pair = {r["mode"]: r for r in runs if r["pair"] == k + 1}
        a, e = pair["approximate"], pair["exact"]
        ratio = float(a["p90"]) / max(1e-9, float(e["p90"]))  # type: ignore[arg-type]
        print(f"pair {k + 1}: TTFT p90 approximate / exact = {ratio:.2f}×")
    if sim:
        print_sim(p, args, sim)
    if args.json is not None:
        saved = vars(args) | {"json": str(args.json), "logs": str(args.logs)}
        out = {"args": saved, "cold_capacity_rps": p.cold_capacity_rps, "rate_model_rps": p.rate_model_rps}
        args.json.write_text(json.dumps(out | {"pressure": p.pressure, "runs": runs, "sim": sim}, indent=1))
    return 0  # the restart's running requests fail: errors are reported, not a failed benchmark


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
