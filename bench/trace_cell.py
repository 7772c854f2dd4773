"""Trace one robustness-grid cell request by request for a kvgate policy (issue 9, item 3).

    python -m bench.trace_cell --workload weka_mix --load 1.2 --seed 3 [--workers 8] [--top 14]

Replays the cell exactly as `kvgate bench sim --grid default` does (same slice, scaling, seed), with
the policy's `decide` wrapped to record, per request, what the router saw at its routing instant:
the winner's predicted TTFT and wait, its lateness (`overdue_s`) and queued prefill, and the best
other candidate's cost with the prefix recomputed there. Joined with what then happened (actual TTFT),
it prints the slowest requests: the table docs/ROUTING.md explains. Not part of the grid's result code
(it lives outside bench/sim, so it does not change the grid's cache keys).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from bench.sim.cluster import simulate
from bench.sim.grid import Cell, default_grid, materialise
from bench.sim.policy_router import PolicyRouter
from bench.sim.profiles import load_profile
from bench.sim.runner import prepare_workload
from policy.config import RoutingConfig
from policy.kvgate import KvgatePolicy
from policy.types import Decision, RequestView, WorkerView


@dataclass(slots=True)
class Seen:
    """One decision as the router saw it."""

    t: float
    prompt: int
    reason: str
    worker: str
    predicted: float
    wait: float
    late: float
    cluster_load: float  # RequestView.cluster_load (policy/state.py LoadMeter)
    pending: int
    inflight: int
    elsewhere: float  # cheapest cost on another worker (its own hit, or a recompute)
    elsewhere_worker: str
    others_inflight: tuple[int, ...]


S = TypeVar("S")
Observer = Callable[[KvgatePolicy, RequestView, Sequence[WorkerView], Decision, float], S]


class RecordingPolicy(Generic[S]):
    """Wraps a policy's `decide` to keep what `observe` makes of each routed decision, by request id
    (the rest of the policy is untouched). bench/hit_value.py records its own view the same way."""

    def __init__(self, policy: KvgatePolicy, observe: Observer[S]) -> None:
        self.policy, self.observe = policy, observe
        self.name = policy.name
        self.seen: dict[str, S] = {}

    def filters(self) -> object:
        return self.policy.filters()

    def decide(
        self, req: RequestView, workers: Sequence[WorkerView], rng: random.Random, now_s: float
    ) -> Decision:
        d = self.policy.decide(req, workers, rng, now_s)
        if d.worker is not None:
            self.seen[req.id] = self.observe(self.policy, req, workers, d, now_s)
        return d


def _observe(
    policy: KvgatePolicy, req: RequestView, workers: Sequence[WorkerView], d: Decision, now_s: float
) -> Seen:
    assert d.worker is not None
    w = next(o for o in workers if o.id == d.worker)
    cost = policy.cost
    others = {o.id: cost.cost_s(req, o) for o in workers if o.id != d.worker}
    best = min(others, key=lambda k: others[k], default=d.worker)
    return Seen(
        t=now_s,
        prompt=req.prompt_tokens,
        reason=d.reason,
        worker=d.worker,
        predicted=d.scores[d.worker]["predicted-ttft"],
        wait=cost.ttft.model.wait_s(w),
        late=w.overdue_s,
        cluster_load=req.cluster_load,
        pending=w.pending_prefill_tokens,
        inflight=w.inflight,
        elsewhere=others.get(best, 0.0),
        elsewhere_worker=best,
        others_inflight=tuple(o.inflight for o in workers if o.id != d.worker),
    )


def trace(cell: Cell, profile_name: str, config: RoutingConfig) -> tuple[list[tuple[float, Seen]], float]:
    """(actual TTFT, what the router saw) per request, slowest first; and the run's TTFT p99."""
    profile = load_profile(profile_name)
    requests = materialise(cell.workload, cell.seed, profile_name)
    workload = prepare_workload(cell.workload.name, requests, profile, cell.workers, cell.load)
    router = PolicyRouter("kvgate", config, cell.seed)
    recording = RecordingPolicy(KvgatePolicy(config), _observe)
    router.policy = recording
    result = simulate(workload.requests, router, profile, cell.workers)
    rows = []
    for r in result.records:
        if r.first_token_s is None:
            continue
        rows.append((r.first_token_s - r.arrival_s, recording.seen[str(r.id)]))
    rows.sort(key=lambda x: -x[0])
    ttfts = sorted(t for t, _ in rows)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else 0.0
    return rows, p99


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True, help="a workload name of the default grid")
    ap.add_argument("--load", type=float, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--top", type=int, default=14, help="slowest requests to print")
    args = ap.parse_args(argv)
    spec = default_grid(["kvgate"])
    workloads = {w.name: w for w in spec.workloads}
    if args.workload not in workloads:
        ap.error(f"unknown workload {args.workload!r}; known: {', '.join(workloads)}")
    cell = Cell(workloads[args.workload], args.load, args.seed, args.workers)
    rows, p99 = trace(cell, spec.profile, RoutingConfig())
    print(f"{cell.label()}: kvgate TTFT p99 {p99:.2f} s over {len(rows)} requests")
    loads = sorted(s.cluster_load for _, s in rows)
    if loads:
        q = [loads[int(f * (len(loads) - 1))] for f in (0.1, 0.5, 0.9)]
        print("cluster load (rho) at the decisions, p10 / p50 / p90: " + " / ".join(f"{x:.2f}" for x in q))
    print(
        "  t(s)  prompt  worker  reason                         predicted  wait   late  pending  "
        "elsewhere  actual  others in flight"
    )
    for actual, s in rows[: args.top]:
        print(
            f"{s.t:6.1f} {s.prompt:7d}  {s.worker:>6}  {s.reason[:30]:30} {s.predicted:9.2f} {s.wait:5.2f} "
            f"{s.late:6.1f} {s.pending:8d} {s.elsewhere:6.2f} {s.elsewhere_worker:>3} {actual:7.1f}  "
            f"{','.join(map(str, s.others_inflight))}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
