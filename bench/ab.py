"""`kvgate bench ab`: an A/B split on the demo stack, both arms' five core metrics from one run.

    kvgate bench ab --candidate round_robin --share 0.5 --json out/ab.json

Starts the demo's stack (embedded Redis, 4 emulated workers with agents, one gateway), routes
`--share` of the traffic with the candidate policy (routing.ab_policy, assigned by `--by` tenant or
first prefix block so a conversation stays in one arm), replays the demo's tenant-system-prompts
scenario once, and reduces the decision log (labelled with the arm) to each arm's figures:
hit_rate (workers' reported cached prompt tokens / prompt tokens), ttft_p50/p99, util_cv (spread of
the request-seconds each worker served for that arm), throughput_rps and queue_p99 (admission wait).
`--from DECISIONS.jsonl` computes the same from a recorded decision log instead of running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.demo import NUM_GPU_BLOCKS, PROFILE, WORKERS
from bench.live_scenarios import TenantPromptsScenario
from bench.loadgen import LiveResult, run_open_loop
from bench.replay import read_log, recorded_metrics, recorded_workers
from bench.stack import Stack


def start_demo_stack(stack: Stack, work_dir: Path, model: str, gateway_toml: str = "") -> tuple[str, Path]:
    """Redis, the demo's 4 workers with agents, and one gateway writing its decision log to a file;
    returns (gateway URL, decision-log path)."""
    stack.start_redis()
    max_seqs = load_max_seqs()
    for i in range(WORKERS):
        url = stack.start_worker(
            f"w{i}",
            model=model,
            profile=PROFILE,
            time_scale=1.0,
            extra=["--num-gpu-blocks", str(NUM_GPU_BLOCKS)],
        )
        stack.start_agent(f"w{i}", url, model=model, extra=["--max-concurrency", str(max_seqs)])
    decisions = work_dir / "decisions.jsonl"
    config = work_dir / "gateway.toml"
    config.write_text(f'[decision_log]\nfile = "{decisions}"\n\n{gateway_toml}')
    gateway = stack.start_gateway("g0", config=config, extra=["--gateway-id", "g0"])
    wait_for_workers(stack.redis_url, model, WORKERS)
    return gateway, decisions


def load_max_seqs() -> int:
    from bench.sim.profiles import load_profile

    return load_profile(PROFILE).max_num_seqs


def wait_for_workers(redis_url: str, model: str, count: int, timeout_s: float = 30.0) -> None:
    """Until `count` agents have registered their workers for `model`."""
    from store import registry
    from store.connect import redis_from_url

    async def registered() -> int:
        redis = redis_from_url(redis_url)
        try:
            return len(await registry.read_workers(redis, model, int(time.time() * 1000)))
        finally:
            await redis.aclose()

    deadline = time.monotonic() + timeout_s
    while asyncio.run(registered()) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} workers registered for {model} in {timeout_s} s")
        time.sleep(0.2)


def wait_for_records(path: Path, count: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The decision log once it holds `count` records (the gateway flushes every 100 ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_log(path) if path.exists() else []
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def arms(records: Sequence[Mapping[str, Any]], shares: Mapping[str, float]) -> list[dict[str, object]]:
    """Each arm's five core metrics (`kvgate bench ab --json` objects), default arm first."""
    workers = recorded_workers([r for r in records if r.get("worker")])
    out = []
    for arm in sorted({str(r.get("arm", "default")) for r in records}, key=lambda a: a != "default"):
        mine = [
            r
            for r in records
            if r.get("arm", "default") == arm and r.get("worker") and r.get("status") == 200
        ]
        if not mine:
            continue
        m = recorded_metrics(sorted(mine, key=lambda r: float(r["arrival_ms"])), workers)
        out.append(
            {
                "arm": arm,
                "policy": str(mine[0].get("policy")),
                "share": shares.get(arm, 0.0),
                "requests": len(mine),
                "refused": sum(1 for r in records if r.get("arm", "default") == arm and not r.get("worker")),
                **{
                    k: _finite(m[k])
                    for k in ("hit_rate", "ttft_p50", "ttft_p99", "util_cv", "throughput_rps", "queue_p99")
                },
            }
        )
    return out


def _finite(value: object) -> object:
    return None if isinstance(value, float) and value != value else value


def run_live(
    candidate: str, share: float, by: str, scenario: TenantPromptsScenario, logs: Path | None
) -> list[dict[str, Any]]:
    toml = (
        f'[routing]\nab_policy = "{candidate}"\nab_share = {share}\nab_by = "{by}"\n\n'
        f'[models."{scenario.model}"]\non_worker_full = "reroute"\n'
    )
    with tempfile.TemporaryDirectory(prefix="kvgate-ab-") as tmp:
        work_dir = logs or Path(tmp)
        with Stack(log_dir=work_dir) as stack:
            print("starting embedded Redis, 4 emulated workers with agents, one gateway ...", file=sys.stderr)
            gateway, decisions = start_demo_stack(stack, work_dir, scenario.model, toml)
            print(
                f"replaying {scenario.requests} requests, {share:.0%} with {candidate} ...", file=sys.stderr
            )
            results: list[LiveResult] = asyncio.run(run_open_loop(gateway, scenario.build()))
            return wait_for_records(decisions, len(results))


def format_arms(rows: Sequence[Mapping[str, Any]]) -> str:
    keys = ("hit_rate", "ttft_p50", "ttft_p99", "util_cv", "throughput_rps", "queue_p99")
    lines = [f"{'arm':<10}{'policy':<14}{'share':>6}{'reqs':>6}" + "".join(f"{k:>15}" for k in keys)]
    for r in rows:
        cells = "".join(
            f"{'-':>15}" if r[k] is None else f"{r[k]:>15.1%}" if k == "hit_rate" else f"{r[k]:>15.3f}"
            for k in keys
        )
        lines.append(f"{r['arm']:<10}{r['policy']:<14}{r['share']:>6.0%}{r['requests']:>6}" + cells)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench ab", description=__doc__.split("\n")[0])
    p.add_argument("--candidate", default="round_robin", help="the candidate arm's routing policy")
    p.add_argument("--share", type=float, default=0.5, help="share of traffic in the candidate arm")
    p.add_argument("--by", choices=("prefix", "tenant"), default="prefix", help="arm assignment key")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (open loop)")
    p.add_argument("--json", type=Path, help='write {"arms": [...]} here')
    p.add_argument("--from", dest="source", type=Path, help="a recorded decision log instead of a live run")
    p.add_argument("--logs", type=Path, help="keep process logs and the decision log here")
    args = p.parse_args(argv)
    if not 0.0 < args.share < 1.0:
        print("kvgate bench ab: --share must be between 0 and 1 (exclusive)", file=sys.stderr)
        return 2
    if args.source is not None:
        records = read_log(args.source)
    else:
        scenario = TenantPromptsScenario(requests=args.requests, rate_rps=args.rate)
        records = run_live(args.candidate, args.share, args.by, scenario, args.logs)
    rows = arms(records, {"default": 1.0 - args.share, "candidate": args.share})
    print(format_arms(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"arms": rows}, indent=2))
    return 0 if len(rows) == 2 else 1
