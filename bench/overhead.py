"""`kvgate bench overhead`: what the kvgate addon costs over a bare mitmdump reverse proxy.

Three targets in front of one trivial upstream (bench/echo_upstream.py, which answers at once so
that the proxies are what saturates): `direct` (no proxy), `mitmdump` (bare reverse proxy with the
same settings kvgate uses) and `kvgate` (the full addon: parsing, hashing, admission through
Redis, routing, release, metrics). For each: saturation requests/s with a closed loop of
concurrent clients; then, open loop at half of bare mitmdump's saturation rate, latency p50/p99 of
non-streaming requests and TTFT p50 of streaming ones. Requests carry 4k-token prompts (a shared
system prompt + a unique question). Results are ratios within one run (the machine is noisy): the
two proxies' saturation is measured in alternating rounds, so a change in the machine's load hits
both alike, together with each proxy process's CPU time per request (from /proc, Linux), which
load on other cores disturbs less than requests/s. A target whose own saturation is below the
open-loop rate (utilization >= 0.9) is flagged `overloaded`: its latencies then measure queueing.
During each open loop the target's CPU use is recorded (`open_loop_cpu_util`, near 1.0 = saturated
at that rate whatever the closed loop said) and the load generator's send lateness (`sender_late_p99`).
Each proxy and the upstream run in a session of their own: Linux's scheduler autogroups share CPU
per session, so in one session the proxy, its upstream and this load generator split one share of a
busy machine between them and the open loop measures that starvation (seconds at p50 with other jobs
running), not the proxy; `--one-session` restores it.
`kvgate proxy` drops mitmproxy's switched-off addons from its event chain (plugin/lean_chain.py), so a
third proxy, `mitmdump_lean` (bare mitmdump with that same chain, saturation only), gives the addon's
own CPU per request (`addon_own_cpu_ms_per_request`) next to the cost over bare mitmdump.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from bench.live_scenarios import filler_text
from bench.loadgen import LiveRequest, percentile, run_open_loop
from bench.stack import Stack, wait_http_ok
from store.redis_server import free_port

MODEL = "bench-model"
PROMPT_TOKENS = 4000


def make_body(rng: random.Random, system: str, i: int, *, stream: bool) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"q{i} " + filler_text(rng, 40)},
        ],
        "max_tokens": 8,
        "stream": stream,
    }


async def saturation_rps(base_url: str, bodies: Callable[[int], dict[str, object]], *, concurrency: int,
                         duration_s: float) -> float:  # fmt: skip
    """Closed loop: `concurrency` clients on keep-alive connections send back to back for `duration_s`."""
    done = 0
    errors = 0
    stop_at = time.perf_counter() + duration_s
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url, connector=connector) as session:

        async def client(c: int) -> None:
            nonlocal done, errors
            i = c
            while time.perf_counter() < stop_at:
                async with session.post("/v1/chat/completions", json=bodies(i)) as resp:
                    await resp.read()
                    if resp.status == 200:
                        done += 1
                    else:
                        errors += 1
                i += concurrency

        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(concurrency)))
        elapsed = time.perf_counter() - started
    if errors:
        print(f"  warning: {errors} non-200 answers from {base_url}", file=sys.stderr)
    return done / elapsed


async def open_loop_latency(base_url: str, bodies: Callable[[int], dict[str, object]], *, rate_rps: float,
                            duration_s: float) -> tuple[float, float, int, float]:  # fmt: skip
    """Open loop, non-streaming: (p50, p99, errors, p99 of how late the load generator sent) — a late
    sender means the generator itself was starved of CPU, not the target slow."""
    latencies: list[float] = []
    late: list[float] = []
    errors = 0
    n = int(rate_rps * duration_s)
    async with aiohttp.ClientSession(base_url, connector=aiohttp.TCPConnector(limit=1024)) as session:
        start = time.perf_counter()

        async def one(i: int) -> None:
            nonlocal errors
            due = start + i / rate_rps
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter()
            late.append(sent - due)
            async with session.post("/v1/chat/completions", json=bodies(i)) as resp:
                await resp.read()
                if resp.status != 200:
                    errors += 1
                    return
            latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*(one(i) for i in range(n)))
    return percentile(latencies, 50), percentile(latencies, 99), errors, percentile(late, 99)


OVERLOADED_UTILIZATION = 0.9  # open-loop rate / the target's own saturation rate


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid` (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def saturation(
    url: str, pid: int | None, args: argparse.Namespace, system: str, seconds: float
) -> tuple[float, float | None]:
    """(requests/s, CPU seconds per request of process `pid`) with a closed loop of `seconds`."""
    rng = random.Random(7)
    before = cpu_seconds(pid) if pid else None
    rps = asyncio.run(
        saturation_rps(url, lambda i: make_body(rng, system, i, stream=False), concurrency=args.concurrency,
                       duration_s=seconds)
    )  # fmt: skip
    after = cpu_seconds(pid) if pid else None
    if before is None or after is None or rps <= 0:
        return rps, None
    return rps, (after - before) / (rps * seconds)


def alternating_saturation(
    targets: dict[str, tuple[str, int]], args: argparse.Namespace, system: str
) -> dict[str, dict[str, float]]:
    """Saturation of each (url, pid) target over `args.rounds` alternating rounds of seconds/rounds each."""
    done: dict[str, list[tuple[float, float | None]]] = {name: [] for name in targets}
    for _ in range(args.rounds):
        for name, (url, pid) in targets.items():
            done[name].append(saturation(url, pid, args, system, args.seconds / args.rounds))
    out: dict[str, dict[str, float]] = {}
    for name, rounds in done.items():
        out[name] = {"saturation_rps": sum(r for r, _ in rounds) / len(rounds)}
        cpus = [c for _, c in rounds if c is not None]
        if cpus:
            out[name]["cpu_ms_per_request"] = 1000 * sum(cpus) / len(cpus)
    return out


def open_loop_point(url: str, pid: int | None, rate: float, seconds: float, system: str) -> dict[str, float]:
    """Open loop of plain requests at `rate`: p50/p99, errors, sender lateness and (with the target's
    `pid`) its CPU use meanwhile: near 1.0 means it was saturated at this rate even if the closed
    loop's saturation said otherwise (an open loop batches less per loop tick)."""
    rng = random.Random(7)
    cpu_before, wall_before = (cpu_seconds(pid) if pid else None), time.perf_counter()
    p50, p99, errors, late_p99 = asyncio.run(
        open_loop_latency(url, lambda i: make_body(rng, system, i, stream=False), rate_rps=rate,
                          duration_s=seconds)
    )  # fmt: skip
    cpu_after, wall = (cpu_seconds(pid) if pid else None), time.perf_counter() - wall_before
    out = {"p50": p50, "p99": p99, "errors": errors, "sender_late_p99": late_p99}
    if cpu_before is not None and cpu_after is not None:
        out["open_loop_cpu_util"] = (cpu_after - cpu_before) / wall
        out["open_loop_cpu_ms_per_request"] = 1000 * (cpu_after - cpu_before) / (rate * seconds)
    return out


def measure(
    url: str, pid: int | None, args: argparse.Namespace, rate: float, system: str, sat_rps: float
) -> dict[str, float]:
    """Open loop at `rate`: p50/p99 latency of plain requests (`open_loop_point`), TTFT p50 of streams,
    and the utilization."""
    out: dict[str, float] = {"saturation_rps": sat_rps} | open_loop_point(
        url, pid, rate, args.seconds, system
    )
    rng = random.Random(8)
    streams = [
        LiveRequest(send_at_s=i / rate, body=make_body(rng, system, i, stream=True))
        for i in range(int(rate * args.seconds))
    ]
    results = asyncio.run(run_open_loop(url, streams))
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    utilization = rate / sat_rps if sat_rps > 0 else float("inf")
    out |= {"ttft_p50": percentile(ttfts, 50), "rate_rps": rate, "open_loop_utilization": utilization,
            "errors": out["errors"] + sum(1 for r in results if not r.ok),
            "overloaded": utilization >= OVERLOADED_UTILIZATION}  # fmt: skip
    return out


def sweep(
    fractions: list[float], targets: dict[str, tuple[str, int]], sat_rps: float, seconds: float, system: str
) -> list[dict[str, object]]:
    """Latency against offered rate: each fraction of bare mitmdump's saturation, each target in turn."""
    points: list[dict[str, object]] = []
    for fraction in fractions:
        rate = fraction * sat_rps
        print(f"sweep: open loop at {rate:.0f} req/s ...", file=sys.stderr)
        point: dict[str, object] = {"fraction": fraction, "rate_rps": rate}
        for name, (url, pid) in targets.items():
            point[name] = open_loop_point(url, pid, rate, seconds, system)
        points.append(point)
    return points


def kvgate_config(path: Path) -> Path:
    # quotas far above what the benchmark offers: admission is measured, not exercised
    path.write_text(f'[models."{MODEL}"]\n\n[admission]\ndefault_total = 100000\n')
    return path


def main(argv: list[str]) -> int:
    if any(a == "--method" or a.startswith("--method=") for a in argv):
        from bench.overhead_peers import main as peers_main  # vllm-router's method, kvgate and the peers

        return peers_main(argv)
    parser = argparse.ArgumentParser(prog="kvgate bench overhead", description=__doc__)
    parser.add_argument(
        "--method", choices=("vllm-router",),
        help="vllm-router's router-overhead method against SMG, sglang-router and vllm-router "
        "(bench/overhead_peers.py; its own options: --method vllm-router --help)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each measurement")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients at saturation")
    parser.add_argument("--rounds", type=int, default=4, help="alternating saturation rounds per proxy")
    parser.add_argument(
        "--sweep", default="", metavar="FRACTIONS",
        help="also latency against offered rate: comma-separated fractions of bare mitmdump's saturation",
    )  # fmt: skip
    parser.add_argument(
        "--one-session", action="store_true",
        help="run the proxies and the upstream in this command's session (one scheduler group, see below)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    rng = random.Random(1)
    system = filler_text(rng, PROMPT_TOKENS)
    load_before = os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-overhead-") as tmp,
        Stack(log_dir=Path(tmp), own_sessions=not args.one_session) as stack,
    ):
        stack.start_redis()
        up_port = free_port()
        upstream = stack.spawn(
            "upstream", [sys.executable, "-m", "bench.echo_upstream", "--port", str(up_port)]
        )
        upstream_url = f"http://127.0.0.1:{up_port}"
        wait_http_ok(f"{upstream_url}/health", 20, upstream.proc)
        mitm_args = [
            "--listen-host", "127.0.0.1", "-q", "--set", "connection_strategy=lazy",
            "--set", "onboarding=false", "--set", "flow_detail=0",
        ]  # fmt: skip
        mitmdump_bin = str(Path(sys.executable).with_name("mitmdump"))
        mitm_port, lean_port = free_port(), free_port()
        mitm = stack.spawn("mitmdump", [
            mitmdump_bin, "--mode", f"reverse:{upstream_url}", "-p", str(mitm_port), *mitm_args,
            "--set", f"confdir={tmp}/mitm",
        ])  # fmt: skip
        lean_script = str(Path(__file__).with_name("lean_mitmdump.py"))
        lean = stack.spawn("mitmdump-lean", [
            mitmdump_bin, "--mode", f"reverse:{upstream_url}", "-p", str(lean_port), *mitm_args,
            "--set", f"confdir={tmp}/mitm-lean", "-s", lean_script,
        ])  # fmt: skip
        mitm_url, lean_url = f"http://127.0.0.1:{mitm_port}", f"http://127.0.0.1:{lean_port}"
        wait_http_ok(f"{mitm_url}/health", 30, mitm.proc)
        wait_http_ok(f"{lean_url}/health", 30, lean.proc)
        kvgate_url = stack.start_gateway(
            "bench", config=kvgate_config(Path(tmp) / "kvgate.toml"),
            extra=["--worker", upstream_url, "--model", MODEL],
        )  # fmt: skip
        kvgate_pid = stack.processes[-1].proc.pid
        print("measuring saturation (the proxies in alternating rounds) ...", file=sys.stderr)
        proxies = {"mitmdump": (mitm_url, mitm.proc.pid), "mitmdump_lean": (lean_url, lean.proc.pid),
                   "kvgate": (kvgate_url, kvgate_pid)}  # fmt: skip
        sats = alternating_saturation(proxies, args, system)
        sats["direct"] = {"saturation_rps": saturation(upstream_url, None, args, system, args.seconds / 2)[0]}
        rate = sats["mitmdump"]["saturation_rps"] / 2
        report: dict[str, object] = {"mitmdump_lean": sats["mitmdump_lean"]}  # saturation only
        targets = (("direct", upstream_url, upstream.proc.pid), ("mitmdump", mitm_url, mitm.proc.pid),
                   ("kvgate", kvgate_url, kvgate_pid))  # fmt: skip
        for name, url, pid in targets:
            print(f"measuring {name} (open loop at {rate:.0f} req/s) ...", file=sys.stderr)
            report[name] = sats[name] | measure(url, pid, args, rate, system, sats[name]["saturation_rps"])
        if args.sweep:
            fractions = [float(f) for f in args.sweep.split(",")]
            both = {"mitmdump": (mitm_url, mitm.proc.pid), "kvgate": (kvgate_url, kvgate_pid)}
            report["sweep"] = sweep(fractions, both, 2 * rate, args.seconds / 2, system)
    direct, mitm_r, kv = (report[k] for k in ("direct", "mitmdump", "kvgate"))
    assert isinstance(mitm_r, dict) and isinstance(kv, dict) and isinstance(direct, dict)
    report |= {
        "addon_added_p50": kv["p50"] - mitm_r["p50"],
        "addon_added_p99": kv["p99"] - mitm_r["p99"],
        "addon_ttft_added_p50": kv["ttft_p50"] - mitm_r["ttft_p50"],
        "rps_ratio_vs_mitmdump": kv["saturation_rps"] / mitm_r["saturation_rps"],
        "prompt_tokens": PROMPT_TOKENS,
        "open_loop_rps": rate,
        # the machine's 1-minute load average before and after: other work on a shared box moves every figure
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if "cpu_ms_per_request" in kv and "cpu_ms_per_request" in mitm_r:
        added = kv["cpu_ms_per_request"] - mitm_r["cpu_ms_per_request"]
        report["addon_cpu_ms_per_request"] = added
        report["addon_cpu_share_of_mitmproxy"] = added / mitm_r["cpu_ms_per_request"]
    lean_r = report["mitmdump_lean"]
    if "cpu_ms_per_request" in kv and isinstance(lean_r, dict) and "cpu_ms_per_request" in lean_r:
        # the addon's own cost: against a mitmdump with kvgate proxy's lean addon chain
        own = kv["cpu_ms_per_request"] - lean_r["cpu_ms_per_request"]
        report["addon_own_cpu_ms_per_request"] = own
        report["addon_own_cpu_share_of_mitmproxy"] = own / lean_r["cpu_ms_per_request"]
    print_report(report, rate)
    for point in report.get("sweep", []):  # type: ignore[attr-defined]
        parts = [f"sweep {point['rate_rps']:>6.0f} req/s:"]
        for name in ("mitmdump", "kvgate"):
            r = point[name]
            parts.append(f"{name} p50 {r['p50'] * 1e3:.2f} p99 {r['p99'] * 1e3:.2f} ms"
                         f" (CPU {r.get('open_loop_cpu_util', float('nan')):.2f})")  # fmt: skip
        print(" ".join(parts))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def print_report(report: dict[str, object], rate: float) -> None:
    print(f"\n{'target':<10} {'sat rps':>10} {'CPU/req':>9} {'p50':>9} {'p99':>9} {'TTFT p50':>9} "
          f"{'util':>5} {'CPU busy':>8} {'CPU/req':>9} {'late p99':>9}  (open {rate:.0f}/s)")  # fmt: skip
    for name in ("direct", "mitmdump", "kvgate"):
        r = report[name]
        assert isinstance(r, dict)
        cpu = f"{r['cpu_ms_per_request']:>7.2f}ms" if "cpu_ms_per_request" in r else f"{'-':>9}"
        flag = "  OVERLOADED: latencies measure queueing" if r["overloaded"] else ""
        util = r["open_loop_utilization"]
        busy = f"{r['open_loop_cpu_util']:>8.2f}" if "open_loop_cpu_util" in r else f"{'-':>8}"
        open_cpu = (
            f"{r['open_loop_cpu_ms_per_request']:>7.2f}ms" if "open_loop_cpu_util" in r else f"{'-':>9}"
        )
        print(f"{name:<10} {r['saturation_rps']:>10.0f} {cpu} {r['p50'] * 1e3:>7.2f}ms "
              f"{r['p99'] * 1e3:>7.2f}ms {r['ttft_p50'] * 1e3:>7.2f}ms {util:>5.2f} {busy} {open_cpu} "
              f"{r['sender_late_p99'] * 1e3:>7.2f}ms{flag}")  # fmt: skip
    line = (
        f"\naddon adds p50 {report['addon_added_p50'] * 1e3:+.2f} ms,"  # type: ignore[operator]
        f" p99 {report['addon_added_p99'] * 1e3:+.2f} ms,"  # type: ignore[operator]
        f" TTFT p50 {report['addon_ttft_added_p50'] * 1e3:+.2f} ms;"  # type: ignore[operator]
        f" saturation {report['rps_ratio_vs_mitmdump']:.0%} of bare mitmdump"
    )
    if "addon_cpu_share_of_mitmproxy" in report:
        line += (
            f"; addon CPU {report['addon_cpu_ms_per_request']:.2f} ms/request ="
            f" {report['addon_cpu_share_of_mitmproxy']:.0%} of mitmproxy's own"
        )
    print(line)
    lean = report.get("mitmdump_lean")
    if isinstance(lean, dict) and "addon_own_cpu_ms_per_request" in report:
        print(f"mitmdump with kvgate proxy's lean addon chain: {lean['saturation_rps']:.0f} req/s,"
              f" {lean['cpu_ms_per_request']:.2f} ms CPU/request; the addon's own CPU against it"
              f" {report['addon_own_cpu_ms_per_request']:.2f} ms/request ="
              f" {report['addon_own_cpu_share_of_mitmproxy']:.0%}")  # fmt: skip
    print(f"machine load average (1 min) before/after: {report['loadavg_1m']} on {os.cpu_count()} cores")
