"""The kvgate gate under other settings on the overload scenario: what each knob buys and costs.

    python -m bench.sim.gate_settings [--router NAME] [--seed N] [--workers N] SETTING ...

A SETTING is `default` or comma-separated `knob=value` pairs of bench/sim/admission.py's KvgateConfig
(`tokens_per_seat`, `max_seats`, `seats_per_worker`, `prefill_budget_tokens`: integers;
`shed_low_after_s`: seconds or `none`; `shares`: high/normal/low, e.g. `0.2/0.6/0.2`), plus
`reserve=F`: seats of the total kept free for the high band (`reserve:2`, docs/ADMISSION.md), as a
fraction of the total. Each setting prints goodput, the high band's TTFT p99 against the half-load
twin, that p99 split into admission wait and engine time (dispatch to first token), the normal band's
goodput and the low band's completions, rejections and longest wait.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from bench.sim.admission import GatedRouter, KvgateConfig, KvgateGate
from bench.sim.cluster import SimResult, simulate
from bench.sim.metrics import admission_metrics
from bench.sim.profiles import EngineProfile, load_profile
from bench.sim.registry import make_router
from bench.sim.scenarios import HALF_LOAD_SCALE, overload_requests
from bench.sim.types import SimRequest
from bench.stats import percentile
from policy.types import Band

INT_KNOBS = ("tokens_per_seat", "max_seats", "seats_per_worker", "prefill_budget_tokens")


def make_gate(setting: str, profile: EngineProfile, workers: int) -> KvgateGate:
    """The kvgate gate for one SETTING (see the module docstring); ValueError names a bad part."""
    knobs: dict[str, object] = {}
    reserve = 0.0
    for part in filter(None, setting.split(",")):
        if part == "default":
            continue
        key, _, value = part.partition("=")
        if key in INT_KNOBS:
            knobs[key] = int(value)
        elif key == "shed_low_after_s":
            knobs[key] = None if value == "none" else float(value)
        elif key == "shares":
            high, normal, low = (float(v) for v in value.split("/"))
            knobs[key] = {Band.HIGH: high, Band.NORMAL: normal, Band.LOW: low}
        elif key == "reserve":
            reserve = float(value)
        else:
            raise ValueError(f"unknown gate setting {part!r} in {setting!r}")
    gate = KvgateGate(profile, workers, KvgateConfig(**knobs))  # type: ignore[arg-type]
    if reserve > 0:
        gate.quota = replace(gate.quota, reserve={Band.HIGH: int(reserve * (gate.quota.total or 0))})
    return gate


def run(
    setting: str, requests: Sequence[SimRequest], router: str, profile: EngineProfile, workers: int, seed: int
) -> SimResult:
    gate = make_gate(setting, profile, workers)
    result = simulate(requests, GatedRouter(make_router(router, seed), gate), profile, workers, gate=gate)
    for rid in gate.dropped:
        result.records[rid].rejected = True
    return result


def describe(setting: str, router: str, profile: EngineProfile, workers: int, seed: int) -> str:
    requests = overload_requests(seed, profile, workers)
    half = overload_requests(seed, profile, workers, load_scale=HALF_LOAD_SCALE, burst=False)
    result = run(setting, requests, router, profile, workers, seed)
    m = admission_metrics(result, requests)
    by = m["by_priority"]
    half_p99 = admission_metrics(run(setting, half, router, profile, workers, seed), half)["by_priority"]
    ref = half_p99["high"]["ttft_p99"]  # type: ignore[index]
    high = [r for r in result.records if r.band == Band.HIGH and r.first_token_s is not None]
    wait = sorted(r.dispatch_s - r.arrival_s for r in high)  # type: ignore[operator]
    engine = sorted(r.first_token_s - r.dispatch_s for r in high)  # type: ignore[operator]
    p99 = by["high"]["ttft_p99"]  # type: ignore[index]
    low = by["low"]  # type: ignore[index]
    return (
        f"{setting:<44} {m['goodput']:>7.1%} {p99:>8.3f} {ref:>8.3f} {p99 / ref:>6.2f}x"
        f" {percentile(wait, 99):>9.3f} {percentile(engine, 99):>9.3f} {by['normal']['goodput']:>7.1%}"  # type: ignore[index]
        f" {low['completed']:>5} {low['rejected']:>5} {low['max_wait']:>7.1f}"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.gate_settings", description=__doc__.split("\n")[0]
    )
    parser.add_argument("settings", nargs="+", metavar="SETTING")
    parser.add_argument("--router", default="least_inflight")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--profile", default="h100-llama3.1-8b")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    try:
        for setting in args.settings:
            make_gate(setting, profile, args.workers)  # fail before the long runs
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"router {args.router}, seed {args.seed}, {args.workers} workers, {args.profile} (times in s)")
    print(
        f"{'setting':<44} {'goodput':>7} {'high p99':>8} {'p99@0.5':>8} {'ratio':>7} {'gate p99':>9}"
        f" {'eng p99':>9} {'normal':>7} {'low done':>5} {'rej':>5} {'max wait':>7}"
    )
    for setting in args.settings:
        print(describe(setting, args.router, profile, args.workers, args.seed), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
