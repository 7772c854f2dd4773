"""Which of churn's faults makes the approximate index lose: the scenario as is, without the bypass
traffic, without w0's restart, and without either, for each index model (docs/SIMULATOR.md, "Churn").

    python -m bench.sim.churn_ablation [--load 1.6] [--seed 1] [--workers 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bench.sim.cluster import simulate
from bench.sim.policy_router import INDEX_MODELS, PolicyRouter
from bench.sim.profiles import load_profile
from bench.sim.runner import prepare_workload
from bench.sim.scenarios import build_scenario, default_load
from bench.stats import percentile
from policy.config import RoutingConfig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.churn_ablation", description=__doc__)
    parser.add_argument("--load", type=float, default=default_load("churn"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--profile", default="h100-llama3.1-8b")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    base = prepare_workload(
        "churn", build_scenario("churn", args.seed), profile, args.workers, args.load
    ).requests
    variants = {
        "as is": base,
        "no bypass": [dataclasses.replace(r, bypass=False) for r in base],
        "no restart": [dataclasses.replace(r, restart_before=()) for r in base],
        "neither": [dataclasses.replace(r, bypass=False, restart_before=()) for r in base],
    }
    for name, reqs in variants.items():
        cells = []
        for index in INDEX_MODELS:
            router = PolicyRouter("kvgate", RoutingConfig(policy="kvgate"), args.seed, index=index)
            records = simulate(reqs, router, profile, args.workers).records
            hit = sum(r.cached_tokens for r in records) / sum(r.input_tokens for r in records)
            ttft = sorted(r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None)
            cells.append(f"{index} hit {hit:.1%} p90 {percentile(ttft, 90):.3f} s")
        print(f"{name:<11} | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
