"""`kvgate bench live`: kvgate and the real peer routers side by side on the same emulated workers.

    kvgate bench live --json out/live/results.json [--workloads tenants,mooncake] [--loads 0.8,2]
        [--routers kvgate,kvgate_x2,smg,sglang,vllm_router,dynamo_select,round_robin] [--passes 2]
        [--workers 4] [--requests 240] [--time-scale 1] [--slo-ttft 2] [--out out/live]

Starts N emulated vLLM workers (bench/emulator, the simulator's engine in real time, one engine
profile: --profile with --num-gpu-blocks), then for each workload and offered load puts every router
in front of them in turn (bench/live_routers.py), the worker caches reset before each router, in
alternating order on even passes so drift shows up as a pass-to-pass difference. The client is the
project's open-loop replayer (bench/loadgen.py), or with `--client aiperf` aiperf 0.13 replaying the same
requests on a fixed schedule (bench/live_aiperf.py).

Measured at the client: TTFT p50/p90/p99, end-to-end p50/p99, errors, throughput, goodput (requests
whose TTFT met --slo-ttft, per second). From the workers' own counters: token hit rate
(vllm:prefix_cache_hits / queries) and each worker's share of the requests. Times are modelled
seconds (wall seconds / --time-scale), comparable with `kvgate bench sim`. Each workload's trace at
each load is written as Mooncake JSONL next to the results, for `kvgate bench sim --trace`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.burst import run_split
from bench.live_aiperf import run_aiperf
from bench.live_routers import LABELS, PEERS_DIR, ROUTERS, Fleet, PeerUnavailable, peer_venv, starter
from bench.live_workloads import (
    WORKLOADS,
    at_load,
    build,
    cap_output,
    live_requests,
    offered_rps,
    write_mooncake_jsonl,
)
from bench.loadgen import LiveResult, percentile
from bench.sim.profiles import EngineProfile, ProfileError, load_profile, scaled
from bench.stack import Stack, StackError
from store.redis_server import free_port

MODEL = "live-model"


@dataclass(frozen=True)
class LiveRun:
    router: str
    workload: str
    load: float
    pass_: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    hit_rate: float
    throughput_rps: float
    goodput_rps: float
    errors: int
    worker_share: list[float]
    requests: int
    ttft_samples: list[float]
    offered_rps: float = 0.0  # requests ÷ arrival span: the ceiling of goodput and throughput at this load

    def document(self) -> dict[str, object]:
        """The run as issue 11's interface spells it (plus `requests`)."""
        doc = asdict(self)
        doc["pass"] = doc.pop("pass_")
        doc.pop("ttft_samples")
        return doc


@dataclass
class WorkerCounters:
    hits: float
    queries: float
    requests: float


def read_counters(url: str) -> WorkerCounters:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0,
              "kvgate_emulator_requests_total": 0.0}  # fmt: skip
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return WorkerCounters(*values.values())


def reset_caches(urls: Sequence[str]) -> None:
    for url in urls:
        req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST", data=b"")
        urllib.request.urlopen(req, timeout=5).close()


def wait_idle(urls: Sequence[str], timeout_s: float = 60.0) -> None:
    """Until no worker holds a request (a previous router's stragglers must not load the next run)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0
        for url in urls:
            with urllib.request.urlopen(f"{url}/kvgate/inflight", timeout=5) as resp:
                busy += len(json.loads(resp.read())["request_ids"])
        if busy == 0:
            return
        time.sleep(0.2)


def summarize(
    router: str, workload: str, load: float, pass_: int, results: Sequence[LiveResult], wall_s: float,
    before: Sequence[WorkerCounters], after: Sequence[WorkerCounters], time_scale: float, slo_s: float,
    offered: float = 0.0,
) -> LiveRun:  # fmt: skip
    ok = [r for r in results if r.ok]
    ttft = sorted(r.ttft_s / time_scale for r in ok if r.ttft_s is not None)
    e2e = [r.e2e_s / time_scale for r in ok if r.e2e_s is not None]
    span = wall_s / time_scale
    hits = sum(a.hits - b.hits for a, b in zip(after, before, strict=True))
    queries = sum(a.queries - b.queries for a, b in zip(after, before, strict=True))
    served = [a.requests - b.requests for a, b in zip(after, before, strict=True)]
    total = sum(served)
    samples = [ttft[min(len(ttft) - 1, (i * len(ttft)) // 200)] for i in range(200)] if ttft else []
    return LiveRun(
        router=router, workload=workload, load=load, pass_=pass_,
        ttft_p50=percentile(ttft, 50), ttft_p90=percentile(ttft, 90), ttft_p99=percentile(ttft, 99),
        e2e_p50=percentile(e2e, 50), e2e_p99=percentile(e2e, 99),
        hit_rate=hits / queries if queries else 0.0,
        throughput_rps=len(ok) / span if span > 0 else 0.0,
        goodput_rps=sum(1 for t in ttft if t <= slo_s) / span if span > 0 else 0.0,
        errors=len(results) - len(ok),
        worker_share=[s / total if total else 0.0 for s in served],
        requests=len(results), ttft_samples=samples, offered_rps=offered,
    )  # fmt: skip


def share_cv(shares: Sequence[float]) -> float:
    """Coefficient of variation of the per-worker shares (0 = perfectly even)."""
    mean = statistics.fmean(shares) if shares else 0.0
    return statistics.pstdev(shares) / mean if mean else math.nan


def start_fleet(stack: Stack, workers: int, profile_path: Path, time_scale: float) -> Fleet:
    urls, endpoints = [], []
    for i in range(workers):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        extra = ["--kv-events-endpoint", endpoint, "--stream-interval-ms", "50"]
        urls.append(stack.start_worker(f"w{i}", model=MODEL, profile=str(profile_path), time_scale=time_scale,
                                       extra=extra))  # fmt: skip
        endpoints.append(endpoint)
    block_size = load_profile(profile_path).block_size
    return Fleet(urls, endpoints, MODEL, block_size)


def write_profile(base: EngineProfile, num_gpu_blocks: int, path: Path) -> Path:
    """The engine profile the workers run (and `kvgate bench sim --profile PATH` replays)."""
    profile = scaled(base, num_gpu_blocks=num_gpu_blocks)
    lines = [f"# {base.name} with num_gpu_blocks = {num_gpu_blocks} (kvgate bench live)"]
    for key, value in asdict(profile).items():
        if key == "sources":
            continue
        lines.append(f"{key} = {json.dumps(value)}")
        if not isinstance(value, str):
            lines.append(f'{key}_source = "{base.name} (kvgate bench live)"')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    load_profile(path)  # validates
    return path


def run_one(
    router: str,
    fleet: Fleet,
    requests: Sequence,
    work_dir: Path,
    peers_dir: Path,
    tokenizer: Path | None = None,
    kvgate_config: Path | None = None,
) -> tuple[list[LiveResult], float]:
    """One router's run; with `tokenizer` (a local tokenizer directory) the client is aiperf."""
    reset_caches(fleet.urls)
    running = starter(router, kvgate_config)(fleet, work_dir, peers_dir)
    try:
        if tokenizer is not None:
            return run_aiperf(
                peer_venv("aiperf", peers_dir), running.urls, MODEL, requests, tokenizer, work_dir
            )
        started = time.perf_counter()
        results = asyncio.run(run_split(running.urls, requests))
        return results, time.perf_counter() - started
    finally:
        running.stop()


def format_table(runs: Sequence[LiveRun], slo_s: float) -> str:
    head = (
        f"{'workload':<9} {'load':>4} {'pass':>4} {'router':<13} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
        f"{'e2e p50':>8} {'p99':>8} {'hit':>6} {'req/s':>6} {f'good@{slo_s:g}s':>9} {'err':>4} {'CV':>5}"
    )
    lines = [head]
    for r in runs:
        lines.append(
            f"{r.workload:<9} {r.load:>4g} {r.pass_:>4} {r.router:<13} {r.ttft_p50:>9.3f} {r.ttft_p90:>8.3f} "
            f"{r.ttft_p99:>8.3f} {r.e2e_p50:>8.2f} {r.e2e_p99:>8.2f} {r.hit_rate:>6.1%} "
            f"{r.throughput_rps:>6.2f} {r.goodput_rps:>9.2f} {r.errors:>4} {share_cv(r.worker_share):>5.2f}"
        )
    return "\n".join(lines)


def plot_cdfs(runs: Sequence[LiveRun], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for workload, load in sorted({(r.workload, r.load) for r in runs}):
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in runs:
            if (r.workload, r.load) == (workload, load) and r.ttft_samples:
                xs = r.ttft_samples
                ax.plot([max(x, 1e-4) for x in xs], [(i + 1) / len(xs) for i in range(len(xs))],
                        label=f"{r.router} pass {r.pass_}", ls="-" if r.pass_ == 1 else "--")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (modelled s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF · {workload} · load {load:g}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        path = out_dir / f"ttft_cdf-{workload}-{load:g}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvgate bench live", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the results here (issue 11's interface)")
    p.add_argument("--out", type=Path, default=Path("out/live"), help="traces, profile, plots, logs")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated: {', '.join(ROUTERS)}")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}"
    )
    p.add_argument("--loads", default="0.8,2", help="offered loads, x capacity without cache hits")
    p.add_argument("--passes", type=int, default=2, help="passes; even passes run the routers in reverse")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--requests", type=int, default=240, help="requests per run")
    p.add_argument("--max-output", type=int, default=256, help="cap on output tokens per request")
    p.add_argument("--profile", default="h100-llama3.1-8b")
    p.add_argument("--num-gpu-blocks", type=int, default=4000, help="KV pool per worker (16-token blocks)")
    p.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per modelled second")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO of goodput, modelled seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--peers-dir", type=Path, default=PEERS_DIR, help="peers' virtualenvs (created if missing)"
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--kvgate-config",
        type=Path,
        help="kvgate's gateways run with this config (default: none, the defaults)",
    )
    p.add_argument(
        "--client", choices=("loadgen", "aiperf"), default="loadgen",
        help="loadgen: the project's open-loop client; aiperf: aiperf 0.13 fixed-schedule replay (own venv)",
    )  # fmt: skip
    args = p.parse_args(list(argv))
    args.routers = [r for r in args.routers.split(",") if r]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.loads = [float(x) for x in args.loads.split(",") if x]
    for r in args.routers:
        if r not in ROUTERS:
            p.error(f"unknown router {r!r}; known: {', '.join(ROUTERS)}")
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    if args.passes < 1 or args.workers < 1 or args.requests < 2 or args.time_scale <= 0:
        p.error("--passes, --workers must be >= 1, --requests >= 2, --time-scale > 0")
    if any(x <= 0 for x in args.loads):
        p.error("--loads must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM unwinds like an exception, so the workers and routers started so far are stopped
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    try:
        base = load_profile(args.profile)
    except ProfileError as e:
        print(f"kvgate bench live: {e}", file=sys.stderr)
        return 2
    profile_path = write_profile(base, args.num_gpu_blocks, out / "profile.toml")
    profile = load_profile(profile_path)
    runs: list[LiveRun] = []
    skipped: dict[str, str] = {}
    tokenizer = None
    if args.client == "aiperf":  # a local tokenizer directory for aiperf's token counts: nothing downloaded
        from bench.toy_model import build as build_tokenizer

        tokenizer = build_tokenizer(out / "tokenizer")
    with Stack(log_dir=out / "logs") as stack:
        print(f"starting {args.workers} emulated workers ({profile_path}) ...", file=sys.stderr)
        fleet = start_fleet(stack, args.workers, profile_path, args.time_scale)
        for workload in args.workloads:
            sim_requests = cap_output(build(workload, args.seed, args.requests), args.max_output)
            for load in args.loads:
                scaled_requests = at_load(sim_requests, profile, args.workers, load)
                write_mooncake_jsonl(scaled_requests, out / f"trace-{workload}-{load:g}.jsonl")
                requests = live_requests(scaled_requests, MODEL, args.time_scale, args.seed)
                offered = offered_rps(scaled_requests)
                print(f"{workload} load {load:g}: {len(requests)} requests offered at {offered:.2f} req/s",
                      file=sys.stderr)  # fmt: skip
                for pass_ in range(1, args.passes + 1):
                    order = args.routers if pass_ % 2 else list(reversed(args.routers))
                    for router in order:
                        if router in skipped:
                            continue
                        wait_idle(fleet.urls)
                        before = [read_counters(u) for u in fleet.urls]
                        print(f"{workload} load {load:g} pass {pass_}: {LABELS[router]} ...", file=sys.stderr)
                        try:
                            results, wall = run_one(
                                router, fleet, requests, out / "logs" / router, args.peers_dir, tokenizer,
                                args.kvgate_config,
                            )  # fmt: skip
                        except (PeerUnavailable, StackError, subprocess.CalledProcessError) as e:
                            skipped[router] = str(e)
                            print(f"  skipped {router}: {e}", file=sys.stderr)
                            continue
                        wait_idle(fleet.urls)
                        after = [read_counters(u) for u in fleet.urls]
                        run = summarize(router, workload, load, pass_, results, wall, before, after,
                                        args.time_scale, args.slo_ttft, offered)  # fmt: skip
                        print(format_table([run], args.slo_ttft).splitlines()[1], file=sys.stderr)
                        runs.append(run)
    print(format_table(runs, args.slo_ttft))
    for router, why in skipped.items():
        print(f"not run: {router}: {why.splitlines()[0]}")
    document = {
        "passes": args.passes,
        "slo_ttft_s": args.slo_ttft,
        "runs": [r.document() for r in runs],
        "workers": args.workers,
        "time_scale": args.time_scale,
        "profile": str(profile_path.resolve()),
        "out": str(out.resolve()),  # traces (trace-<workload>-<load>.jsonl), plots, logs
        "client": "aiperf 0.13.0 (fixed-schedule replay)"
        if args.client == "aiperf"
        else "bench/loadgen.py (open loop)",
        "labels": {r: LABELS[r] for r in args.routers},
        "skipped": skipped,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2))
    if not args.no_plots and runs:
        for path in plot_cdfs(runs, out):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if runs and all(r.errors == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
