"""How wrong kvgate's index is where it routes, per index model, against the engines' true caches
(docs/BENCHMARKS.md §99: what hit feedback can and cannot correct).

    python -m bench.sim.index_errors [--scenario churn] [--load 1.6] [--seed 1] [--workers 8]

Per routed request, at its routing: `held, lost` (the index expected the chosen worker to hold more
than one block more than its engine did: what a short cached-tokens report reveals, at the response's
end) and `unseen holder` (another worker's engine held more than one block more than the chosen one,
and the index knew of no worker holding more than it expected on the chosen one: what only the engines'
events reveal, e.g. caches filled by traffic that bypassed the router). For `feedback`, also how many
reports dropped entries, and for a scenario with a restart, when the first report after it arrived;
`--tail N` lists each model's N slowest first tokens.
"""

from __future__ import annotations

import argparse
import sys

from bench.sim.cluster import simulate
from bench.sim.policy_router import INDEX_MODELS, PolicyRouter
from bench.sim.profiles import load_profile
from bench.sim.runner import prepare_workload
from bench.sim.scenarios import build_scenario, default_load
from bench.sim.types import ClusterView, SimRequest
from bench.stats import percentile
from policy.config import RoutingConfig


class Inspected(PolicyRouter):
    """kvgate's router, counting at each decision how its index compares with the engines' caches."""

    def __init__(self, seed: int, index: str) -> None:
        super().__init__("kvgate", RoutingConfig(policy="kvgate"), seed, index=index)
        self.counts = {"routed": 0, "held, lost": 0, "unseen holder": 0}
        self.reports: list[tuple[float, float]] = []  # (arrival, report time) of reports that dropped entries

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        believed = self.state.index.match(req.block_ids)  # as prepare() reads it (approx: no speculation)
        worker = super().route(req, cluster, now_s)
        truth = {w: cluster.cached_prefix_blocks(w, req) for w in cluster.worker_ids}
        expected = believed.get(worker, 0)
        self.counts["routed"] += 1
        self.counts["held, lost"] += truth[worker] + 1 < expected
        self.counts["unseen holder"] += (
            max(truth.values()) > truth[worker] + 1 and max(believed.values(), default=0) <= expected
        )
        return worker

    def on_usage(self, req: SimRequest, worker_id: str, cached_tokens: int, now_s: float) -> None:
        misses = self.feedback_misses
        super().on_usage(req, worker_id, cached_tokens, now_s)
        if self.feedback_misses > misses:
            self.reports.append((req.arrival_s, now_s))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.index_errors", description=__doc__)
    parser.add_argument("--scenario", default="churn")
    parser.add_argument("--load", type=float)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--tail", type=int, default=0, help="also list the N slowest first tokens")
    parser.add_argument("--profile", default="h100-llama3.1-8b")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    load = args.load if args.load is not None else default_load(args.scenario)
    scenario = build_scenario(args.scenario, args.seed, args.limit)
    reqs = prepare_workload(args.scenario, scenario, profile, args.workers, load).requests
    restart = next((r.arrival_s for r in reqs if r.restart_before), None)
    print(f"{args.scenario} load {load} seed {args.seed}, {args.workers} workers"
          + (f"; restart at {restart:.2f} s" if restart is not None else ""))  # fmt: skip
    for index in INDEX_MODELS:
        router = Inspected(args.seed, index)
        records = simulate(reqs, router, profile, args.workers).records
        ttft = sorted(r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None)
        c = router.counts
        line = (f"{index:<8} p90 {percentile(ttft, 90):.3f} s | routed {c['routed']}, held-lost "
                f"{c['held, lost']}, unseen holder {c['unseen holder']}")  # fmt: skip
        if index == "feedback":
            dropped = router.feedback_dropped
            line += f" | reports that dropped entries {router.feedback_misses} ({dropped} entries)"
            after = [rep for rep in router.reports if restart is not None and rep[0] >= restart]
            if after:
                line += (
                    f"; first after the restart: arrived {after[0][0]:.2f} s, reported {after[0][1]:.2f} s"
                )
        print(line, flush=True)
        slowest = sorted(
            records, key=lambda r: -1 if r.first_token_s is None else r.first_token_s - r.arrival_s
        )
        for r in reversed(slowest[-args.tail :] if args.tail else []):
            assert r.first_token_s is not None
            ttft = r.first_token_s - r.arrival_s
            print(f"    ttft {ttft:.2f} s: arrived {r.arrival_s:.2f} s on {r.worker}, "
                  f"cached {r.cached_tokens} of {r.input_tokens} tokens")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
