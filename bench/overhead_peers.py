"""`kvgate bench overhead --method vllm-router`: router overhead the way vllm-router measures its own
(vllm-project/router docs/benchmarks/router_overhead.md), for kvgate and the real peers alike.

Each router is put in front of 4 fast mock workers (bench/echo_upstream.py, which answer at once
and also serve vLLM's /tokenize and /v1/chat/completions/render, so vllm-router's cache_aware does
the per-worker render it does in production). A closed loop of `concurrency` clients, each sending
its next request after reading the previous answer, runs for a warm-up and a measurement per cell.
Cells: corpus x prompt size x concurrency.

  corpora   hot64: the client cycles through 64 fixed prompts; cold: a unique marker at the start of
            every prompt (no shared prefix), the rest from a pool of 256 distinct bodies
  sizes     prompt bytes, default 200, 2048, 16384
  requests  one chat user message, max_tokens 16, not streamed, no session id

`mitmdump` is a bare mitmdump reverse proxy (no addon, one worker): the floor kvgate is built on.
`direct` is the same client against the workers themselves (the client spreads over the 4 in turn):
a router's added latency is its p50 (mean) minus direct's p50 (mean) in the same cell and pass.
CPU per 1,000 requests is the router's process tree (the process and its children, from /proc)
over the warm-up and the measurement, per successful request; kvgate's Redis is stated
separately (`redis_cpu_ms_per_1k`). Unlike vllm-router's harness, a router starts once per pass,
not once per cell, and its startup is not counted. Each pass runs the routers in the given order,
even passes in reverse.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.live_routers import PEERS_DIR, Fleet, PeerUnavailable, RunningRouter, start_sglang_family
from bench.loadgen import percentile
from bench.stack import Stack, StackError, wait_http_ok
from store.redis_server import free_port

MODEL = "bench-model"
ROUTERS = ("kvgate", "mitmdump", "smg", "sglang", "vllm_router")
CORPORA = ("hot64", "cold")
SEED = 0x244  # vllm-router's corpus seed
POOL = 256
_WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "router",
    "cache",
    "prefix",
    "token",
    "worker",
    "queue",
    "latency",
    "batch",
    "decode",
    "prefill",
]


def _body_text(rng: random.Random, size: int) -> str:
    words: list[str] = []
    length = 0
    while length < size:
        w = rng.choice(_WORDS) + str(rng.randrange(1000))
        words.append(w)
        length += len(w) + 1
    return " ".join(words)[:size]


class Corpus:
    """Request bodies (JSON bytes) of one corpus and prompt size, by request index."""

    def __init__(self, name: str, size: int) -> None:
        if name not in CORPORA:
            raise ValueError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
        rng = random.Random(SEED * 100_003 + size)
        self.name, self.size = name, size
        count = 64 if name == "hot64" else POOL
        self._texts = [_body_text(rng, size) for _ in range(count)]
        self._hot = [self._encode(t) for t in self._texts] if name == "hot64" else []

    @staticmethod
    def _encode(text: str) -> bytes:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
        return json.dumps(body).encode()

    def body(self, i: int) -> bytes:
        if self._hot:
            return self._hot[i % len(self._hot)]
        marker = f"cold-{i:09d} "
        return self._encode((marker + self._texts[i % POOL])[: self.size])


@dataclass
class Cell:
    target: str
    corpus: str
    size: int
    concurrency: int
    pass_: int
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    cpu_ms_per_1k: float | None = None
    redis_cpu_ms_per_1k: float | None = None
    p50_minus_direct_ms: float | None = None
    mean_minus_direct_ms: float | None = None


async def closed_loop(
    urls: Sequence[str], body: Callable[[int], bytes], concurrency: int, warmup_s: float, measure_s: float
) -> tuple[list[float], int, int, float]:
    """(latencies of the measurement, its errors, requests done in warm-up + measurement, measure wall)."""
    latencies: list[float] = []
    errors = 0
    done = 0
    headers = {"content-type": "application/json"}
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + measure_s
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def client(c: int) -> None:
            nonlocal errors, done
            i = c
            while (sent := time.perf_counter()) < stop_at:
                url = urls[i % len(urls)] + "/v1/chat/completions"
                ok = False
                try:
                    async with session.post(url, data=body(i), headers=headers) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (TimeoutError, aiohttp.ClientError):
                    pass
                if ok:
                    done += 1
                if sent >= measure_from:
                    if ok:
                        latencies.append(time.perf_counter() - sent)
                    else:
                        errors += 1
                i += concurrency

        await asyncio.gather(*(client(c) for c in range(concurrency)))
    return latencies, errors, done, measure_s


def _children(pid: int) -> list[int]:
    """`pid` and all its descendants (Linux /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its live descendants, with their reaped children's time."""
    total = 0.0
    for p in _children(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Target:
    name: str
    urls: list[str]
    pid: int | None  # root of the router's process tree (None: direct)
    redis_pid: int | None = None


def start_kvgate(fleet: Fleet, log_dir: Path) -> tuple[RunningRouter, Target]:
    stack = Stack(log_dir=log_dir)
    try:
        stack.start_redis()
        config = log_dir / "kvgate.toml"
        log_dir.mkdir(parents=True, exist_ok=True)
        # quotas far above what the benchmark offers: admission is measured, not exercised
        config.write_text(f'[models."{MODEL}"]\n\n[admission]\ndefault_total = 1000000\n')
        extra = [a for url in fleet.urls for a in ("--worker", url)] + ["--model", MODEL]
        url = stack.start_gateway("overhead", config=config, extra=extra)
    except BaseException:
        stack.close()
        raise
    redis_pid = stack.redis.pid if stack.redis is not None else None
    return RunningRouter("kvgate", [url], stack), Target(
        "kvgate", [url], stack.processes[-1].proc.pid, redis_pid
    )


def start_mitmdump(fleet: Fleet, log_dir: Path) -> tuple[RunningRouter, Target]:
    """Bare mitmdump reverse proxy (kvgate's settings, no addon) to worker 0: the floor under kvgate."""
    stack = Stack(log_dir=log_dir)
    port = free_port()
    mitmdump = str(Path(sys.executable).with_name("mitmdump"))
    args = [mitmdump, "--mode", f"reverse:{fleet.urls[0]}", "-p", str(port), "--listen-host", "127.0.0.1",
            "-q", "--set", "connection_strategy=lazy", "--set", "onboarding=false", "--set", "flow_detail=0",
            "--set", f"confdir={log_dir}/mitm"]  # fmt: skip
    try:
        process = stack.spawn("mitmdump", args)
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", 30, process.proc)
    except BaseException:
        stack.close()
        raise
    return RunningRouter("mitmdump", [url], stack), Target("mitmdump", [url], process.proc.pid)


def start_target(name: str, fleet: Fleet, log_dir: Path, peers_dir: Path) -> tuple[RunningRouter, Target]:
    if name == "kvgate":
        return start_kvgate(fleet, log_dir)
    if name == "mitmdump":
        return start_mitmdump(fleet, log_dir)
    running = start_sglang_family(name, fleet, log_dir, peers_dir)
    pid = running.stack.processes[0].proc.pid
    return running, Target(name, running.urls, pid)


def measure_cell(
    target: Target, corpus: Corpus, concurrency: int, pass_: int, warmup_s: float, measure_s: float
) -> Cell:
    cpu0 = tree_cpu_seconds(target.pid) if target.pid else None
    redis0 = tree_cpu_seconds(target.redis_pid) if target.redis_pid else None
    latencies, errors, done, wall = asyncio.run(
        closed_loop(target.urls, corpus.body, concurrency, warmup_s, measure_s)
    )
    cell = Cell(
        target=target.name, corpus=corpus.name, size=corpus.size, concurrency=concurrency, pass_=pass_,
        requests=len(latencies), errors=errors, rps=len(latencies) / wall,
        p50_ms=percentile(latencies, 50) * 1e3, p99_ms=percentile(latencies, 99) * 1e3,
        mean_ms=statistics.fmean(latencies) * 1e3 if latencies else float("nan"),
    )  # fmt: skip
    if cpu0 is not None and target.pid and done:
        cell.cpu_ms_per_1k = (tree_cpu_seconds(target.pid) - cpu0) * 1e6 / done
    if redis0 is not None and target.redis_pid and done:
        cell.redis_cpu_ms_per_1k = (tree_cpu_seconds(target.redis_pid) - redis0) * 1e6 / done
    return cell


def subtract_direct(cells: list[Cell]) -> None:
    direct = {(c.corpus, c.size, c.concurrency, c.pass_): c for c in cells if c.target == "direct"}
    for c in cells:
        d = direct.get((c.corpus, c.size, c.concurrency, c.pass_))
        if d is not None and c.target != "direct":
            c.p50_minus_direct_ms = c.p50_ms - d.p50_ms
            c.mean_minus_direct_ms = c.mean_ms - d.mean_ms


def summarize(cells: Sequence[Cell]) -> dict[str, dict[str, float]]:
    """Per target and concurrency: medians over cells and passes of added p50/mean and CPU per 1k."""
    out: dict[str, dict[str, float]] = {}
    for c in cells:
        if c.target == "direct":
            continue
        key = f"{c.target}@c{c.concurrency}"
        out.setdefault(key, {})
    for key in out:
        target, conc = key.split("@c")
        mine = [c for c in cells if c.target == target and c.concurrency == int(conc)]
        p50s = [c.p50_minus_direct_ms for c in mine if c.p50_minus_direct_ms is not None]
        means = [c.mean_minus_direct_ms for c in mine if c.mean_minus_direct_ms is not None]
        cpus = [c.cpu_ms_per_1k for c in mine if c.cpu_ms_per_1k is not None]
        reds = [c.redis_cpu_ms_per_1k for c in mine if c.redis_cpu_ms_per_1k is not None]
        out[key] = {"added_p50_ms": statistics.median(p50s) if p50s else float("nan"),
                    "added_mean_ms": statistics.median(means) if means else float("nan"),
                    "cpu_ms_per_1k": statistics.median(cpus) if cpus else float("nan"),
                    "errors": sum(c.errors for c in mine)}  # fmt: skip
        if reds:
            out[key]["redis_cpu_ms_per_1k"] = statistics.median(reds)
    return out


def goal(cells: Sequence[Cell]) -> list[dict[str, object]]:
    """Concurrency 1, per cell and pass: kvgate's added p50 against min(smg, vllm_router) + 1 ms."""
    rows = []
    keys = sorted({(c.corpus, c.size, c.pass_) for c in cells if c.concurrency == 1})
    for corpus, size, pass_ in keys:
        added = {c.target: c.p50_minus_direct_ms for c in cells
                 if (c.corpus, c.size, c.pass_, c.concurrency) == (corpus, size, pass_, 1)}  # fmt: skip
        peers = [added[p] for p in ("smg", "vllm_router") if added.get(p) is not None]
        kv = added.get("kvgate")
        if kv is None or not peers:
            continue
        bound = min(peers) + 1.0  # type: ignore[type-var]
        rows.append({"corpus": corpus, "size": size, "pass": pass_, "kvgate_added_p50_ms": kv,
                     "bound_ms": bound, "met": kv <= bound})  # fmt: skip
    return rows


def format_cells(cells: Sequence[Cell]) -> str:
    lines = [f"{'target':<12} {'corpus':<6} {'bytes':>6} {'conc':>4} {'pass':>4} {'req/s':>7} {'p50 ms':>8} "
             f"{'p99 ms':>8} {'+p50':>7} {'+mean':>7} {'CPU ms/1k':>10} {'redis':>7} {'err':>4}"]  # fmt: skip
    for c in cells:

        def f(x: float | None, w: int, p: int = 2) -> str:
            return f"{'-':>{w}}" if x is None else f"{x:>{w}.{p}f}"

        lines.append(
            f"{c.target:<12} {c.corpus:<6} {c.size:>6} {c.concurrency:>4} {c.pass_:>4} {c.rps:>7.0f} "
            f"{c.p50_ms:>8.2f} {c.p99_ms:>8.2f} {f(c.p50_minus_direct_ms, 7)} {f(c.mean_minus_direct_ms, 7)} "
            f"{f(c.cpu_ms_per_1k, 10, 0)} {f(c.redis_cpu_ms_per_1k, 7, 0)} {c.errors:>4}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvgate bench overhead --method vllm-router", description=__doc__)
    p.add_argument("--method", choices=("vllm-router",), default="vllm-router")
    p.add_argument("--json", type=Path, help="write every cell and the summary here")
    p.add_argument(
        "--routers", default=",".join(ROUTERS), help=f"comma-separated, in order: {', '.join(ROUTERS)}"
    )
    p.add_argument("--corpora", default=",".join(CORPORA))
    p.add_argument("--sizes", default="200,2048,16384", help="prompt bytes")
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--workers", type=int, default=4, help="mock workers")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per cell")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds of measurement per cell")
    p.add_argument("--passes", type=int, default=1, help="passes; even passes run the routers in reverse")
    p.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    args = p.parse_args(list(argv))
    args.routers = [r for r in args.routers.split(",") if r]
    for r in args.routers:
        if r not in ROUTERS:
            p.error(f"unknown router {r!r}; known: {', '.join(ROUTERS)}")
    args.corpora = [c for c in args.corpora.split(",") if c]
    for c in args.corpora:
        if c not in CORPORA:
            p.error(f"unknown corpus {c!r}; known: {', '.join(CORPORA)}")
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if any(s < 16 for s in args.sizes) or any(c < 1 for c in args.concurrency) or args.workers < 1:
        p.error("--sizes must be >= 16 bytes, --concurrency and --workers >= 1")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    corpora = [Corpus(name, size) for name in args.corpora for size in args.sizes]
    cells: list[Cell] = []
    skipped: dict[str, str] = {}
    load_before = os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-overhead-peers-") as tmp,
        Stack(log_dir=Path(tmp)) as stack,
    ):
        urls = []
        for i in range(args.workers):
            port = free_port()
            w = stack.spawn(f"mock{i}", [sys.executable, "-m", "bench.echo_upstream", "--port", str(port),
                                          "--model", MODEL])  # fmt: skip
            urls.append(f"http://127.0.0.1:{port}")
            wait_http_ok(f"{urls[-1]}/health", 20, w.proc)
        fleet = Fleet(urls, [], MODEL, 16)
        for pass_ in range(1, args.passes + 1):
            order = ["direct", *(args.routers if pass_ % 2 else reversed(args.routers))]
            for name in order:
                if name in skipped:
                    continue
                running = None
                if name == "direct":
                    target = Target("direct", urls, None)
                else:
                    print(f"pass {pass_}: starting {name} ...", file=sys.stderr)
                    try:
                        running, target = start_target(
                            name, fleet, Path(tmp) / f"{name}-{pass_}", args.peers_dir
                        )
                    except (PeerUnavailable, StackError) as e:
                        skipped[name] = str(e)
                        print(f"  skipped {name}: {str(e).splitlines()[0]}", file=sys.stderr)
                        continue
                try:
                    for corpus in corpora:
                        for conc in args.concurrency:
                            cell = measure_cell(target, corpus, conc, pass_, args.warmup, args.seconds)
                            print(format_cells([cell]).splitlines()[1], file=sys.stderr)
                            cells.append(cell)
                finally:
                    if running is not None:
                        running.stop()
    subtract_direct(cells)
    summary = summarize(cells)
    goal_rows = goal(cells)
    print(format_cells(cells))
    print("\nmedians over cells and passes (ms; CPU per 1,000 requests of the router's process tree):")
    for key, s in sorted(summary.items()):
        extra = f", Redis {s['redis_cpu_ms_per_1k']:.0f}" if "redis_cpu_ms_per_1k" in s else ""
        print(f"  {key:<18} added p50 {s['added_p50_ms']:+.2f}  mean {s['added_mean_ms']:+.2f}  "
              f"CPU/1k {s['cpu_ms_per_1k']:.0f}{extra}  errors {s['errors']:.0f}")  # fmt: skip
    if goal_rows:
        met = sum(1 for r in goal_rows if r["met"])
        print(
            "goal (concurrency 1: kvgate's added p50 <= min(smg, vllm_router) + 1 ms):"
            f" {met}/{len(goal_rows)} cells"
        )
    for name, why in skipped.items():
        print(f"not run: {name}: {why.splitlines()[0]}")
    document = {
        "method": "vllm-router router_overhead (docs/benchmarks/router_overhead.md), kvgate bench overhead",
        "workers": args.workers, "warmup_s": args.warmup, "measure_s": args.seconds, "passes": args.passes,
        "routers": args.routers, "cells": [asdict(c) for c in cells], "summary": summary, "goal": goal_rows,
        "skipped": skipped, "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2))
    return 0 if cells and all(c.errors == 0 for c in cells) and not skipped else 1
