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

`--paired` runs the modes at once instead: each mode gets its own stack (Redis, 4 workers and their
agents, its gateway), and every request of the one open-loop schedule is sent to each gateway in turn,
the next copy `--offset-ms` after the first (default half the mean gap) and the sides taking turns at
being first. The two 30 s windows of the sequential A/B become one, so the machine's load (this
benchmark's own processes and everything else on the cores) falls on both modes alike. It prints the
same table, each side's p50 and p99 over the first side's, and the client paired delta: the median over
the requests of a side's client TTFT − the first side's. `--order approximate,approximate` is its null
test (it should read ~1.00 and ~0 ms).

    python -m bench.exact_demo [--requests 240] [--rate 8] [--order exact,approximate] [--decision-log DIR]
        [--paired [--offset-ms MS]] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import aiohttp
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
from bench.loadgen import LiveRequest, LiveResult, run_open_loop, send_streaming
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


@dataclass(frozen=True)
class Counters:
    """A stack's counters at one moment: the workers' prefix-cache hits and queries, their own TTFT sum
    and count, the CPU seconds of each kind of process."""

    hits: float
    queries: float
    ttft: tuple[float, float]
    cpu: dict[str, float]


def counters(stack: Stack) -> Counters:
    hits, queries = prefix_cache_counters(stack.worker_urls)
    return Counters(hits, queries, worker_ttft(stack.worker_urls), cpu_seconds(stack))


def start_workers(stack: Stack, scenario: TenantPromptsScenario, tokenizer: Path | None) -> dict[str, str]:
    """The stack's 4 emulated workers (2,000 KV blocks each, publishing KV events); their event
    endpoints by worker id."""
    endpoints = {}
    for i in range(WORKERS):
        wid, endpoints[f"w{i}"] = f"w{i}", f"tcp://127.0.0.1:{free_port()}"
        stack.start_worker(
            wid, model=scenario.model, profile=PROFILE, time_scale=1.0,
            extra=["--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--kv-events-endpoint", endpoints[wid],
                   *(["--tokenizer", str(tokenizer)] if tokenizer else [])],
        )  # fmt: skip
    return endpoints


def start_mode(
    stack: Stack,
    mode: str,
    label: str,
    scenario: TenantPromptsScenario,
    endpoints: dict[str, str],
    tokenizer: Path | None = None,
    decision_log: Path | None = None,
) -> str:
    """Agents again (following the KV events unless `mode` is approximate), a gateway in `mode` named
    `label`, the workers' caches reset; the gateway's URL once it routes to every worker."""
    for i, url in enumerate(stack.worker_urls):
        stack.stop_process(f"agent-w{i}")
        kv = ["--kv-events", endpoints[f"w{i}"]] if mode != "approximate" else []
        stack.start_agent(f"w{i}", url, model=scenario.model, extra=kv)
    config = stack.log_dir / f"gateway-{label}.toml"
    local = f'tokenizer = "{tokenizer}"\n' if tokenizer is not None and mode == "exact" else ""
    log = f'\n[decision_log]\nfile = "{decision_log / f"decisions-{label}.jsonl"}"\n' if decision_log else ""
    prefix_mode = "exact" if mode == "exact" else "approximate"
    config.write_text(
        f'[routing]\nprefix_mode = "{prefix_mode}"\n\n[models."{scenario.model}"]\n{local}{log}'
    )
    gateway = stack.start_gateway(label, config=config)
    wait_routable(gateway, WORKERS)
    reset_caches(stack.worker_urls)
    return gateway


def demo_requests(scenario: TenantPromptsScenario) -> list[LiveRequest]:
    """The scenario's requests, each with an x-request-id (`demo-<i>`): the decision records of two
    modes pair up request by request."""
    return [
        replace(q, headers={**q.headers, "x-request-id": f"demo-{i}"}) for i, q in enumerate(scenario.build())
    ]


def finish(
    stack: Stack,
    gateway: str,
    label: str,
    requests: list[LiveRequest],
    results: list[LiveResult],
    wall_s: float,
    before: Counters,
) -> tuple[RunSummary, dict[str, float]]:
    """The run's summary and extras from the counters since `before`; stops the gateway."""
    after = counters(stack)
    extra = gateway_metrics(stack.metrics_urls[gateway])
    for key in [k for k in extra if k.startswith("cpu_ms")]:
        extra[key] = round(extra[key] * 1000 / len(requests), 3)
    for role, used in after.cpu.items():  # CPU the run cost each kind of process (ms per request)
        extra[f"proc_cpu_ms{{{role}}}"] = round((used - before.cpu.get(role, 0.0)) * 1000 / len(requests), 2)
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    extra["client_ttft_mean_ms"] = round(sum(ttfts) * 1000 / max(1, len(ttfts)), 2)
    extra["worker_ttft_mean_ms"] = round(
        (after.ttft[0] - before.ttft[0]) * 1000 / max(1.0, after.ttft[1] - before.ttft[1]), 2
    )
    # spread: distinct (system prompt, worker) pairs the requests used (12 = each tenant on one worker)
    extra["placements"] = len(
        {(json.dumps(q.body["messages"][0]), r.worker) for q, r in zip(requests, results, strict=True)}  # type: ignore[index]
    )
    stack.stop_process(f"gateway-{label}")
    summary = summarize(label, results, wall_s, after.hits - before.hits, after.queries - before.queries)
    return summary, extra


def run(
    stack: Stack,
    mode: str,
    label: str,
    scenario: TenantPromptsScenario,
    endpoints: dict[str, str],
    tokenizer: Path | None = None,
    decision_log: Path | None = None,
) -> tuple[RunSummary, dict[str, float]]:
    """One mode alone on `stack` (the sequential A/B)."""
    gateway = start_mode(stack, mode, label, scenario, endpoints, tokenizer, decision_log)
    before = counters(stack)
    requests = demo_requests(scenario)
    started = time.perf_counter()
    results = asyncio.run(run_open_loop(gateway, requests))
    return finish(stack, gateway, label, requests, results, time.perf_counter() - started, before)


def labels(modes: list[str]) -> list[str]:
    """A name per side: its mode, with `-2`, `-3`, ... for a mode's repeats (`approximate,approximate`
    is the pairing's null test)."""
    out: list[str] = []
    for mode in modes:
        repeats = sum(1 for m in out if m == mode or m.startswith(f"{mode}-"))
        out.append(mode if repeats == 0 else f"{mode}-{repeats + 1}")
    return out


def interleave(requests: list[LiveRequest], sides: int, offset_s: float) -> list[list[LiveRequest]]:
    """One open-loop schedule for `sides` gateways: request i goes to every side, side s at its send
    time + `offset_s` × ((i + s) mod sides), so the sides take turns being first and each pair falls in
    the same moment of the machine's load."""
    return [
        [replace(q, send_at_s=q.send_at_s + offset_s * ((i + s) % sides)) for i, q in enumerate(requests)]
        for s in range(sides)
    ]


async def run_paired(
    urls: list[str], schedules: list[list[LiveRequest]], *, timeout_s: float = 300.0
) -> list[list[LiveResult]]:
    """Every side's schedule against its gateway from one start time and one event loop; the results
    per side, in request order."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with contextlib.AsyncExitStack() as stack:
        sessions = [
            await stack.enter_async_context(
                aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=512), timeout=timeout)
            )
            for url in urls
        ]
        start = time.perf_counter()

        async def one(session: aiohttp.ClientSession, index: int, req: LiveRequest) -> LiveResult:
            delay = start + req.send_at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await send_streaming(session, index, req)

        flat = await asyncio.gather(
            *(one(s, i, r) for s, reqs in zip(sessions, schedules, strict=True) for i, r in enumerate(reqs))
        )
    n = len(schedules[0])
    return [list(flat[k * n : (k + 1) * n]) for k in range(len(schedules))]


def client_paired(
    ours: list[LiveResult], base: list[LiveResult], *, hits_only: bool = False
) -> tuple[float, int] | None:
    """(median over the requests both sides served of our client TTFT − the base side's, in ms; count).
    `hits_only`: only the requests that were a hit on both sides (the worker reported at least half the
    prompt cached), so that a miss on one side (a ~160 ms prefill here) does not enter the pair."""

    def hit(r: LiveResult) -> bool:
        return 2 * r.cached_tokens >= r.prompt_tokens > 0

    deltas = [
        (a.ttft_s - b.ttft_s) * 1000
        for a, b in zip(ours, base, strict=True)
        if a.ok and b.ok and a.ttft_s is not None and b.ttft_s is not None
        and (not hits_only or (hit(a) and hit(b)))
    ]  # fmt: skip
    return (statistics.median(deltas), len(deltas)) if deltas else None


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


def segments(record: dict[str, object]) -> dict[str, float]:
    """A decision record's time split, ms: the gateway's loop stages (`stage_us`), arrival → handed
    upstream (`gateway_ms`), handed upstream → the worker's response headers, headers → first token."""
    stages = record.get("stage_us")
    out = {f"stage {k}": v / 1000 for k, v in stages.items()} if isinstance(stages, dict) else {}
    gateway, headers, ttft = record.get("gateway_ms"), record.get("headers_ms"), record.get("ttft_ms")
    if isinstance(gateway, int | float):
        out["arrival → sent"] = gateway
        if isinstance(headers, int | float):
            out["sent → worker headers"] = headers - gateway
    if isinstance(headers, int | float) and isinstance(ttft, int | float):
        out["headers → first token"] = ttft - headers
    if isinstance(ttft, int | float):
        out["ttft"] = ttft
    return out


def paired_segments(log_dir: Path, mode: str, base: str) -> dict[str, tuple[float, float, float]]:
    """Per segment (`segments`): (median of `base`'s, median of `mode`'s, median over the requests
    both logged of `mode`'s − `base`'s), ms, from the decision logs in `log_dir`. Empty if one is missing."""
    runs = []
    for m in (base, mode):
        path = log_dir / f"decisions-{m}.jsonl"
        if not path.exists():
            return {}
        records = (json.loads(line) for line in path.read_text().splitlines() if line)
        runs.append({r["client_request_id"]: segments(r) for r in records if "ttft_ms" in r})
    theirs, ours = runs
    both = sorted(ours.keys() & theirs.keys())
    names = sorted({k for key in both for k in ours[key].keys() | theirs[key].keys()})
    out = {}
    for name in names:
        pairs = [(theirs[k][name], ours[k][name]) for k in both if name in theirs[k] and name in ours[k]]
        if not pairs:  # a stage only one side has (exact mode's tokenize): its own median
            a = [theirs[k][name] for k in both if name in theirs[k]]
            b = [ours[k][name] for k in both if name in ours[k]]
            out[name] = (
                statistics.median(a) if a else 0.0, statistics.median(b) if b else 0.0,
                (statistics.median(b) if b else 0.0) - (statistics.median(a) if a else 0.0),
            )  # fmt: skip
            continue
        out[name] = (
            statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            statistics.median(p[1] - p[0] for p in pairs),
        )  # fmt: skip
    return out


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
        "--paired",
        action="store_true",
        help="run the modes of --order at once, each on its own stack (Redis, 4 workers, their agents, a "
        "gateway), every request sent to each in turn in the same window; deltas against the first",
    )
    parser.add_argument(
        "--offset-ms",
        type=float,
        help="--paired: how long after a request's first copy the next side's is sent (default: half the "
        "mean gap between requests)",
    )
    parser.add_argument(
        "--decision-log", type=Path, help="write each mode's decision records to DIR/decisions-MODE.jsonl"
    )
    parser.add_argument("--json", type=Path, help="also write the runs and the paired deltas here")
    args = parser.parse_args(argv)
    modes = args.order.split(",")
    if any(m not in MODES for m in modes):
        parser.error(f"--order: modes are {', '.join(MODES)}, not {args.order!r}")
    if args.paired and len(modes) < 2:
        parser.error("--paired needs at least two modes in --order")
    if args.decision_log:
        args.decision_log.mkdir(parents=True, exist_ok=True)
    names = labels(modes)
    runs: list[tuple[RunSummary, dict[str, float]]] = []
    client: dict[str, tuple[float, int] | None] = {}
    per_request: dict[str, list[dict[str, object]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-exact-") as tmp, contextlib.ExitStack() as closing:
        log_dir = args.logs or Path(tmp)
        tokenizer = toy_model.build(Path(tmp) / "model") if args.local_tokenizer else None
        count = token_counter(tokenizer)
        # the prompts in the workers' own tokens, so the printed working set is what their KV holds
        scenario = TenantPromptsScenario(requests=args.requests, rate_rps=args.rate).sized_for(count)
        # sequential: one stack, the modes one after the other; paired: a stack per mode, all at once
        stacks = [
            closing.enter_context(Stack(log_dir=log_dir / name if args.paired else log_dir))
            for name in (names if args.paired else names[:1])
        ]
        endpoints = []
        for stack in stacks:
            stack.start_redis()
            endpoints.append(start_workers(stack, scenario, tokenizer))
        if not args.paired:
            for mode, name in zip(modes, names, strict=True):
                print(f"{name} run ...", file=sys.stderr)
                local = tokenizer if mode == "exact" else None
                runs.append(run(stacks[0], mode, name, scenario, endpoints[0], local, args.decision_log))
        else:
            gateways = [
                start_mode(stack, mode, name, scenario, ends, tokenizer, args.decision_log)
                for stack, mode, name, ends in zip(stacks, modes, names, endpoints, strict=True)
            ]
            print(f"{' + '.join(names)} paired run ...", file=sys.stderr)
            before = [counters(stack) for stack in stacks]
            requests = demo_requests(scenario)
            offset_s = args.offset_ms / 1000 if args.offset_ms is not None else 0.5 / scenario.rate_rps
            started = time.perf_counter()
            results = asyncio.run(run_paired(gateways, interleave(requests, len(stacks), offset_s)))
            wall_s = time.perf_counter() - started
            for stack, gateway, name, res, c0 in zip(stacks, gateways, names, results, before, strict=True):
                runs.append(finish(stack, gateway, name, requests, res, wall_s, c0))
            for name, res in zip(names[1:], results[1:], strict=True):
                client[name] = client_paired(res, results[0])
                client[f"{name} hits"] = client_paired(res, results[0], hits_only=True)
            per_request = {
                name: [
                    {"ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1000, 3),
                     "cached": r.cached_tokens, "prompt": r.prompt_tokens, "worker": r.worker}
                    for r in res
                ]
                for name, res in zip(names, results, strict=True)
            }  # fmt: skip
    working_set = scenario.working_set_tokens(count)
    estimate = sum(len(p) for p in scenario.system_prompts()) / CHARS_PER_TOKEN
    tokens, each = "toy BPE" if tokenizer else "fake tokenizer", working_set / scenario.tenants
    print(
        f"\n{scenario.tenants} tenants × {each:.0f}-token system prompts ({tokens}: "
        f"{scenario.chars_per_token:.2f} characters per token; approximate mode's estimate "
        f"{estimate / scenario.tenants:.0f}), {scenario.requests} requests at {scenario.rate_rps}/s, "
        f"{WORKERS} workers{' per mode, the modes paired' if args.paired else ''}; cache pressure "
        f"{working_set / KV_TOKENS:.2f}× one worker, {working_set / (WORKERS * KV_TOKENS):.2f}× the cluster"
    )
    print(
        f"{'mode':<12} {'TTFT p50':>10} {'TTFT p99':>10} {'hit rate':>9} {'req/s':>7} {'errors':>6}  gateway"
    )
    for r, extra in runs:
        print(f"{r.policy:<12} {r.ttft_p50 * 1000:>8.1f}ms {r.ttft_p99 * 1000:>8.1f}ms {r.hit_rate:>9.1%} "
              f"{r.throughput_rps:>7.2f} {r.errors:>6}  {json.dumps(extra, sort_keys=True)}")  # fmt: skip
    base = names[0] if args.paired else "approximate"
    logged: dict[str, tuple[float, int] | None] = {}
    split: dict[str, dict[str, tuple[float, float, float]]] = {}  # the decision records' time split
    for name in [n for n in names if n != base] if args.decision_log else ():
        logged[name] = paired = paired_ttft_delta(args.decision_log, name, base)
        if paired is not None:
            print(f"paired TTFT delta {name} − {base}: median {paired[0]:+.2f} ms, {paired[1]} requests")
        split[name] = paired_segments(args.decision_log, name, base)
        for segment, (a, b, diff) in split[name].items():
            print(f"  {segment:<24} {base} {a:8.3f} ms  {name} {b:8.3f} ms  paired {diff:+.3f} ms")
    first = runs[0][0]
    for (r, _), name in zip(runs[1:], names[1:], strict=True) if args.paired else ():
        delta, hits = client.get(name), client.get(f"{name} hits")
        print(
            f"same window, {name} / {base}: TTFT p50 {r.ttft_p50 / first.ttft_p50:.3f}, p99 "
            f"{r.ttft_p99 / first.ttft_p99:.3f}; client paired delta "
            + (f"median {delta[0]:+.2f} ms, {delta[1]} requests" if delta else "none")
            + (f" (a hit on both sides: {hits[0]:+.2f} ms, {hits[1]})" if hits else "")
        )
    if args.json:
        out = {
            "paired": args.paired,
            "runs": [{**asdict(r), "extra": extra} for r, extra in runs],
            "client_paired_delta_ms": {k: v[0] for k, v in client.items() if v},
            "logged_paired_delta_ms": {k: v[0] for k, v in logged.items() if v},
            # per segment: [base's median, this side's median, the paired median of the difference], ms
            "logged_segments_ms": split,
            "requests": per_request,  # --paired: each side's client results, in request order
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r.errors == 0 for r, _ in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
