"""The churn scenario live (issue 13): approximate against exact prefix index on emulated workers.

The simulator's `churn` (bench/sim/scenarios.py) at the scale of one machine: 4 emulated vLLM workers
with `--blocks` KV blocks each, `--tenants` system prompts (Zipf s = 0.9) whose working set is larger
than the pooled KV, a fifth of the requests sent straight to one worker per tenant (clients that bypass
the gateway), and worker w0's prefix cache reset halfway through (a restart: vLLM's AllBlocksCleared).
The offered rate should sit past what the workers serve without cache hits, as in the simulator.

Run 1: agents without KV events, gateway `prefix_mode = "approximate"`. Run 2: agents with `--kv-events`,
gateway `prefix_mode = "exact"` with the local tokenizer (bench/toy_model.py; workers load the same).
Caches are reset before each run. Prints TTFT p50/p90/p99 of the routed requests and the workers' own
prefix-cache hit rate (all traffic). There is no live oracle: the simulator reports that one.

    python -m bench.churn_live [--requests 400] [--rate 10] [--tenants 24] [--blocks 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import zlib
from pathlib import Path

from bench import toy_model
from bench.demo import PROFILE, WORKERS, prefix_cache_counters, reset_caches
from bench.exact_demo import wait_routable
from bench.live_scenarios import filler_text
from bench.loadgen import LiveRequest, LiveResult, run_open_loop
from bench.stack import Stack
from bench.stats import percentile
from store.redis_server import free_port

MODEL = "demo-model"


def build(
    seed: int, requests: int, rate: float, tenants: int, system_tokens: int
) -> list[tuple[LiveRequest, int | None]]:
    """(request, None) for the gateway or (request, worker index) for a client that bypasses it."""
    rng = random.Random(seed)
    prompts = [f"You are assistant {t}. " + filler_text(rng, system_tokens) for t in range(tenants)]
    weights = [1.0 / (k + 1) ** 0.9 for k in range(tenants)]
    out: list[tuple[LiveRequest, int | None]] = []
    send_at = 0.0
    for i in range(requests):
        send_at += rng.expovariate(rate)
        tenant = rng.choices(range(tenants), weights=weights)[0]
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": prompts[tenant]},
                {"role": "user", "content": f"Question {i}: " + filler_text(rng, rng.randint(30, 200))},
            ],
            "max_tokens": 16,
        }
        bypass = zlib.crc32(f"t{tenant}".encode()) % WORKERS if rng.random() < 0.2 else None
        out.append((LiveRequest(send_at_s=send_at, body=body), bypass))
    return out


async def _drive(
    gateway: str, worker_urls: list[str], plan: list[tuple[LiveRequest, int | None]], restart_at_s: float
) -> list[LiveResult]:
    """The routed requests' results; bypass requests and the restart run beside them."""

    async def restart() -> None:
        await asyncio.sleep(restart_at_s)
        await asyncio.to_thread(reset_caches, worker_urls[:1])

    routed = [r for r, w in plan if w is None]
    direct = [run_open_loop(worker_urls[w], [r for r, x in plan if x == w]) for w in range(len(worker_urls))]
    results, _, _ = await asyncio.gather(run_open_loop(gateway, routed), asyncio.gather(*direct), restart())
    return results


def run(
    stack: Stack, mode: str, plan: list[tuple[LiveRequest, int | None]], tokenizer: Path
) -> dict[str, float]:
    config = stack.log_dir / f"gateway-{mode}.toml"
    local = f'tokenizer = "{tokenizer}"\n' if mode == "exact" else ""
    config.write_text(f'[routing]\nprefix_mode = "{mode}"\n\n[models."{MODEL}"]\n{local}')
    gateway = stack.start_gateway(mode, config=config)
    wait_routable(gateway, WORKERS)
    reset_caches(stack.worker_urls)
    time.sleep(1.0)  # the agents publish the cleared caches
    hits0, queries0 = prefix_cache_counters(stack.worker_urls)
    restart_at = plan[len(plan) // 2][0].send_at_s
    results = asyncio.run(_drive(gateway, stack.worker_urls, plan, restart_at))
    hits1, queries1 = prefix_cache_counters(stack.worker_urls)
    stack.stop_process(f"gateway-{mode}")
    ttfts = sorted(r.ttft_s for r in results if r.ok and r.ttft_s is not None)
    return {
        "hit": (hits1 - hits0) / max(1.0, queries1 - queries0),
        "p50": percentile(ttfts, 50),
        "p90": percentile(ttfts, 90),
        "p99": percentile(ttfts, 99),
        "errors": float(sum(not r.ok for r in results)),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.churn_live", description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second (open loop)")
    parser.add_argument("--tenants", type=int, default=24)
    parser.add_argument("--system-tokens", type=int, default=3000)
    parser.add_argument("--blocks", type=int, default=1500, help="KV blocks (16 tokens) per worker")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--logs", type=Path, help="keep process logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    plan = build(args.seed, args.requests, args.rate, args.tenants, args.system_tokens)
    out = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-churn-") as tmp,
        Stack(log_dir=args.logs or Path(tmp)) as stack,
    ):
        stack.start_redis()
        tokenizer = toy_model.build(Path(tmp) / "model")
        endpoints = {}
        for i in range(WORKERS):
            wid, endpoints[f"w{i}"] = f"w{i}", f"tcp://127.0.0.1:{free_port()}"
            url = stack.start_worker(
                wid, model=MODEL, profile=PROFILE, time_scale=1.0,
                extra=["--num-gpu-blocks", str(args.blocks), "--kv-events-endpoint", endpoints[wid],
                       "--tokenizer", str(tokenizer)],
            )  # fmt: skip
            stack.start_agent(wid, url, model=MODEL)
        print("approximate run ...", file=sys.stderr)
        out["approximate"] = run(stack, "approximate", plan, tokenizer)
        for i, url in enumerate(stack.worker_urls):
            stack.stop_process(f"agent-w{i}")
            stack.start_agent(f"w{i}", url, model=MODEL, extra=["--kv-events", endpoints[f"w{i}"]])
        print("exact run ...", file=sys.stderr)
        out["exact"] = run(stack, "exact", plan, tokenizer)
    pressure = args.tenants * args.system_tokens / (args.blocks * 16 * WORKERS)
    bypass = sum(w is not None for _, w in plan)
    print(
        f"\nchurn live: {args.tenants} tenants × {args.system_tokens} tokens "
        f"({pressure:.2f}× the pooled KV), "
        f"{args.requests} requests at {args.rate}/s, {bypass} bypass the gateway, w0 reset halfway"
    )
    print(f"{'mode':<12} {'hit':>6} {'p50':>8} {'p90':>8} {'p99':>8} errors")
    for mode, r in out.items():
        print(
            f"{mode:<12} {r['hit']:>6.1%} {r['p50']:>7.3f}s {r['p90']:>7.3f}s {r['p99']:>7.3f}s "
            f"{r['errors']:.0f}"
        )
    ratio = out["approximate"]["p90"] / max(1e-9, out["exact"]["p90"])
    print(f"TTFT p90 approximate / exact = {ratio:.2f}×")
    return 0 if all(r["errors"] == 0 for r in out.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
