"""Timing check of the engine model (not a test): replay a slice of a Mooncake trace on ONE engine the way
the simulator drives it, and print the wall time.

    .venv/bin/python -m bench.sim.engine_microbench [--requests 1500] [--every 8] [--load 0.8]
        [--profile h100-llama3.1-8b] [--trace PATH] [--reference] [--profile-code]

Takes every `--every`-th request of the trace (1/8 of the conversation trace ~ one of 8 workers' share),
scales arrivals to `--load` of one engine's capacity (bench/sim/load.py), and for each arrival delivers the
engine's events through next_event_s()/advance(), asks cached_prefix_blocks() (as a router would), then
submits. 512-token trace blocks are the cache keys.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import time
from pathlib import Path

from bench.sim.engine import Engine, EngineEvent, EngineRequest, Finished, FirstToken
from bench.sim.load import scale_to_load
from bench.sim.profiles import load_profile
from bench.sim.traces import load_trace
from bench.stats import percentile

DEFAULT_TRACE = Path("/work/shared/traces/mooncake_fast25/conversation_trace.jsonl")


def replay(
    engine: Engine, requests: list[EngineRequest], arrivals: list[float], lookahead: bool = True
) -> list[EngineEvent]:
    events: list[EngineEvent] = []
    for req, at_s in [*zip(requests, arrivals, strict=True), (None, math.inf)]:
        while lookahead and (next_s := engine.next_event_s()) is not None and next_s <= at_s:
            events += engine.advance(next_s)
        events += engine.advance(at_s)
        if req is not None:
            engine.cached_prefix_blocks(req.blocks)
            engine.submit(req, at_s)
    return events


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--profile", default="h100-llama3.1-8b")
    parser.add_argument("--reference", action="store_true", help="step one step at a time (slow reference)")
    parser.add_argument(
        "--no-lookahead", action="store_true", help="deliver events by advance() to each arrival only"
    )
    parser.add_argument("--profile-code", action="store_true", help="print a cProfile of the replay")
    args = parser.parse_args(argv)

    profile = load_profile(args.profile)
    trace = load_trace(args.trace, limit=args.requests * args.every)[:: args.every][: args.requests]
    sims, plan = scale_to_load(profile, trace, workers=1, load=args.load)
    requests = [
        EngineRequest(r.id, tuple(zip(r.block_ids, r.block_tokens, strict=True)), r.output_tokens)
        for r in sims
    ]
    engine = Engine(profile, reference=args.reference)
    profiler = cProfile.Profile() if args.profile_code else None
    started, cpu_started = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    events = replay(engine, requests, [r.arrival_s for r in sims], lookahead=not args.no_lookahead)
    if profiler:
        profiler.disable()
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started

    arrival: dict[int | str, float] = {r.id: r.arrival_s for r in sims}
    ttft = sorted(e.at_s - arrival[e.id] for e in events if isinstance(e, FirstToken))
    finished = sum(isinstance(e, Finished) for e in events)
    hit = engine.prefix_cache_hits / max(1, engine.prefix_cache_queries)
    print(
        f"{len(requests)} requests on 1 engine ({profile.name}, load {plan.load}, "
        f"{'reference' if args.reference else 'fast'} mode): wall {wall_s:.2f} s (CPU {cpu_s:.2f} s); "
        f"virtual {engine._clock:.0f} s, busy {engine.busy_s:.0f} s, {engine.num_steps} steps, "
        f"{finished} finished, {engine.num_preemptions} preemptions, hit rate {hit:.3f}, "
        f"TTFT p50 {percentile(ttft, 50):.3f} s p99 {percentile(ttft, 99):.3f} s"
    )
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(18)


if __name__ == "__main__":
    main()
