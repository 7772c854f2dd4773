"""The addon's own CPU per request, in process: KvGate's hooks without mitmproxy's proxy around them.

A real embedded redis-server, one registered worker, the bench's 4k-token requests (shared system
prompt + unique question, bench/overhead.py); `concurrency` requests at a time go through
request → responseheaders → response (a small JSON completion), and the background tasks
(release, decision log, index writes, mirror) run on the same loop. Prints CPU µs per request
(process time of a round: its requests and a 0.25 s drain of their background work, flow construction
excluded) and, with `--profile PATH`, writes cProfile stats of the measured part. The figure issue 12's
overhead goal names; the end-to-end one is `kvgate bench overhead`'s `addon_own_cpu_ms_per_request`.

With `--rounds R` the measurement is repeated R times in the one process (each round its own fresh
requests), and the report adds the rounds' median, minimum and spread: on a shared machine a round that
another process disturbed reads high, so the median and the minimum of several short rounds move far
less between runs than one long round (docs/BENCHMARKS.md, session 8). `--gc freeze` (the default)
collects and freezes what the warm-up built before each round, so the collector's full passes do not
walk the long-lived heap at times that differ between runs; the rounds' own garbage is still collected
as usual (`--gc on` leaves the collector alone, `--gc off` disables it during rounds). `--json PATH`
writes every round; bench/hook_cost_ab.py runs this file against several trees, round by round.

    python -m bench.hook_cost [--requests 3000] [--concurrency 8] [--rounds 1] [--gc freeze|on|off]
                              [--profile /tmp/hooks.prof] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mitmproxy import http
from mitmproxy.test import taddons, tflow, tutils

from bench.live_scenarios import filler_text
from bench.overhead import MODEL, PROMPT_TOKENS, kvgate_config, make_body
from plugin.addon import KvGate
from plugin.mirror import wall_ms
from runtime import compat
from store import registry
from store.redis_server import EmbeddedRedis
from store.registry import WorkerRecord

COMPLETION = json.dumps(
    {"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 4000, "completion_tokens": 1}}
).encode()


def make_flow(body: dict[str, object]) -> http.HTTPFlow:
    flow = tflow.tflow(
        req=tutils.treq(
            method=b"POST", path=b"/v1/chat/completions", content=json.dumps(body).encode(),
            headers=http.Headers(host="gateway", content_type="application/json"),
        )
    )  # fmt: skip
    flow.client_conn.timestamp_end = None  # still connected
    return flow


async def one(gate: KvGate, flow: http.HTTPFlow, response: http.Response) -> None:
    await gate.request(flow)
    if flow.response is not None:
        raise RuntimeError(f"refused: {flow.response.content!r}")
    flow.response = response
    gate.responseheaders(flow)
    gate.response(flow)


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(1)
    system = filler_text(rng, PROMPT_TOKENS)
    embedded = EmbeddedRedis().start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = kvgate_config(Path(tmp) / "kvgate.toml")
            gate = KvGate()
            with taddons.context(gate) as tctx:
                tctx.configure(gate, kvgate_config=str(config), kvgate_redis_url=embedded.url)
                await gate.running()
                assert gate.redis is not None and gate.mirror is not None
                worker = WorkerRecord(id="w0", model=MODEL, url="http://127.0.0.1:9")
                await registry.register(gate.redis, worker, 600_000, wall_ms())
                await gate.mirror.refresh()
                try:
                    await measure(gate, args, system, rng)
                finally:
                    await gate.done()
    finally:
        embedded.stop()


async def measure(gate: KvGate, args: argparse.Namespace, system: str, rng: random.Random) -> None:
    warm = [make_flow(make_body(rng, system, i, stream=False)) for i in range(200)]
    for flow in warm:
        await one(gate, flow, tutils.tresp(content=COMPLETION))
    await asyncio.sleep(0.3)  # background writes of the warm-up done
    profiler = cProfile.Profile() if args.profile else None
    rounds: list[float] = []
    split: list[tuple[float, float]] = []  # (user, system) µs per request of each round (getrusage)
    wall_total = 0.0

    async def next_round() -> None:
        nonlocal wall_total
        base = 1000 + len(rounds) * args.requests
        flows = [make_flow(make_body(rng, system, base + i, stream=False)) for i in range(args.requests)]
        responses = [tutils.tresp(content=COMPLETION) for _ in flows]  # built outside the measurement too
        cpu, wall, user, kernel = await measure_round(gate, args, flows, responses, profiler)
        rounds.append(1e6 * cpu / args.requests)
        split.append((1e6 * user / args.requests, 1e6 * kernel / args.requests))
        wall_total += wall

    if args.serve:
        # driven by bench/hook_cost_ab.py: "ready", then one round per line read ("round"), its figure
        # printed as a line; end of input ends the run
        print("ready", flush=True)
        while (await asyncio.to_thread(sys.stdin.readline)).strip() == "round":
            await next_round()
            print(f"{rounds[-1]:.3f} {split[-1][0]:.3f} {split[-1][1]:.3f}", flush=True)
    else:
        for _ in range(args.rounds):
            await next_round()
    if profiler is not None:
        profiler.dump_stats(args.profile)
    if not rounds:
        return
    line = (
        f"{args.requests} requests, concurrency {args.concurrency}: {statistics.fmean(rounds):.0f} µs CPU "
        f"per request (wall {wall_total:.2f} s, releases {gate.releases})"
    )
    if len(rounds) > 1:
        med = statistics.median(rounds)
        line += (
            f"; {len(rounds)} rounds: median {med:.0f}, min {min(rounds):.0f}, max {max(rounds):.0f} "
            f"(spread {100 * (max(rounds) - min(rounds)) / med:.0f} % of the median)"
        )
    print(line, file=sys.stderr if args.serve else sys.stdout)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "requests": args.requests,
                    "concurrency": args.concurrency,
                    "gc": args.gc,
                    "rounds_us_per_request": rounds,
                    "rounds_user_system": split,
                    "mean": statistics.fmean(rounds),
                    "median": statistics.median(rounds),
                    "min": min(rounds),
                }
            )
        )


async def measure_round(
    gate: KvGate,
    args: argparse.Namespace,
    flows: list[http.HTTPFlow],
    responses: list[http.Response],
    profiler: cProfile.Profile | None,
) -> tuple[float, float, float, float]:
    """Process CPU, wall, user and system seconds of one round: its requests, `concurrency` at a time,
    then 0.25 s for the last releases, records and index writes to go out."""
    if args.gc != "on":
        gc.collect()
        gc.freeze()  # the warm-up's and earlier rounds' objects: not walked by this round's collections
        if args.gc == "off":
            gc.disable()
    try:
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        for start in range(0, len(flows), args.concurrency):
            end = start + args.concurrency
            await asyncio.gather(
                *(one(gate, f, r) for f, r in zip(flows[start:end], responses[start:end], strict=True))
            )
        await asyncio.sleep(0.25)  # let the last releases, records and index writes go out
        if profiler is not None:
            profiler.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return cpu, wall, usage.ru_utime - usage0.ru_utime, usage.ru_stime - usage0.ru_stime
    finally:
        if args.gc != "on":
            gc.enable()
            gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    compat.install()
    parser = argparse.ArgumentParser(prog="python -m bench.hook_cost", description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="measurements of --requests each, in turn")
    parser.add_argument(
        "--gc", choices=("freeze", "on", "off"), default="freeze",
        help="before each round collect and freeze the heap (default), leave the collector alone, "
        "or disable it",
    )  # fmt: skip
    parser.add_argument("--profile", default="", help="write cProfile stats of the measured part here")
    parser.add_argument("--json", default="", help="write every round's µs CPU per request here")
    parser.add_argument(
        "--serve", action="store_true",
        help="after the warm-up print 'ready', then run one round per 'round' line on stdin and print its "
        "µs CPU per request (bench/hook_cost_ab.py drives several trees this way, round by round)",
    )  # fmt: skip
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
