"""The engine-queue guard in the simulator: where the time goes at overload, and what each budget buys.

    python -m bench.queue_guard [--workloads tenants,mooncake,weka] [--loads 0.8,2] [--budgets 0,0.5,1,2,4]
        [--signal dispatched] [--policies kvgate] [--requests 300] [--workers 4] [--num-gpu-blocks 2500]
        [--slo-ttft 2] [--json PATH]

Each workload is built exactly as `kvgate bench live` builds it (bench/live_workloads.py, the same seed,
output cap and engine profile with the same KV pool), scaled to each load, and replayed with the kvgate
routing policy behind the `kvgate_guard` gate (bench/sim/admission.py: no quota, only the gateway's
guard on the routing decision, `policy.admission.door_wait_s` read with `--signal` and
`queue_too_deep`) for each budget in seconds; budget 0 is no gate at all,
which is what the gateway runs without a quota. Per run: TTFT p50/p99 of the served requests, the time
they spent at the gate (arrival to dispatch: always 0 here, there is no gate queue) and in the engine
(dispatch to first token), refused requests, throughput and goodput (served requests with TTFT within
the SLO) per second of the run's span (first arrival to last finish), as `kvgate bench live` counts them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.live import write_profile
from bench.live_workloads import at_load, build, cap_output
from bench.sim.admission import GatedRouter, QueueGuardGate
from bench.sim.cluster import simulate
from bench.sim.profiles import load_profile
from bench.sim.registry import make_router
from bench.stats import percentile
from policy.admission import DEFAULT_QUEUE_SIGNAL, QUEUE_SIGNALS


def run_one(
    requests: Sequence[object], profile_path: Path, workers: int, budget_s: float, slo_s: float,
    policy: str = "kvgate", signal: str = DEFAULT_QUEUE_SIGNAL,
) -> dict[str, float]:  # fmt: skip
    profile = load_profile(profile_path)
    gate = QueueGuardGate(profile, budget_s, signal)
    router = GatedRouter(make_router(policy, 1), gate)
    result = simulate(requests, router, profile, workers, gate=gate)  # type: ignore[arg-type]
    served = [r for r in result.records if r.first_token_s is not None and r.finish_s is not None]
    ttft = sorted(r.first_token_s - r.arrival_s for r in served)  # type: ignore[operator]
    gate_s = sorted(r.dispatch_s - r.arrival_s for r in served)  # type: ignore[operator]
    engine_s = sorted(r.first_token_s - r.dispatch_s for r in served)  # type: ignore[operator]
    start = min(r.arrival_s for r in result.records)
    span = max(r.finish_s for r in served) - start  # type: ignore[type-var]
    return {
        "budget_s": budget_s,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "gate_p50": percentile(gate_s, 50),
        "gate_p99": percentile(gate_s, 99),
        "engine_p50": percentile(engine_s, 50),
        "engine_p99": percentile(engine_s, 99),
        "refused": sum(r.rejected for r in result.records),
        "requests": len(result.records),
        "throughput_rps": len(served) / span,
        "goodput_rps": sum(1 for t in ttft if t <= slo_s) / span,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.queue_guard", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="tenants,mooncake,weka")
    p.add_argument("--policies", default="kvgate", help="routing policies (bench/sim/registry.py names)")
    p.add_argument("--loads", default="0.8,2")
    p.add_argument("--budgets", default="0,0.5,1,2,4", help="max_queue in seconds; 0 = no gate")
    p.add_argument("--signal", default=DEFAULT_QUEUE_SIGNAL, choices=sorted(QUEUE_SIGNALS))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--num-gpu-blocks", type=int, default=2500)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--profile", default="h100-llama3.1-8b")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("out/queue_guard"))
    p.add_argument("--json", type=Path)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    profile_path = write_profile(load_profile(args.profile), args.num_gpu_blocks, args.out / "profile.toml")
    profile = load_profile(profile_path)
    rows = []
    head = ("policy", "workload", "load", "budget s", "TTFT p50", "p99", "gate p50", "engine p50", "p99",
            "refused", "req/s", f"good@{args.slo_ttft:g}s")  # fmt: skip
    print(" ".join(f"{h:>10}" for h in head))
    for workload in [w for w in args.workloads.split(",") if w]:
        base = cap_output(build(workload, args.seed, args.requests), args.max_output)
        for load in [float(x) for x in args.loads.split(",") if x]:
            requests = at_load(base, profile, args.workers, load)
            for policy, budget in [
                (p, float(x)) for p in args.policies.split(",") if p for x in args.budgets.split(",") if x
            ]:
                row: dict[str, object] = {"policy": policy, "workload": workload, "load": load}
                row |= run_one(
                    requests, profile_path, args.workers, budget, args.slo_ttft, policy, args.signal
                )
                rows.append(row)
                cells = (policy, workload, f"{load:g}", f"{budget:g}",
                         f"{row['ttft_p50']:.3f}", f"{row['ttft_p99']:.3f}",
                         f"{row['gate_p50']:.3f}", f"{row['engine_p50']:.3f}", f"{row['engine_p99']:.3f}",
                         f"{row['refused']:.0f}/{row['requests']:.0f}", f"{row['throughput_rps']:.2f}",
                         f"{row['goodput_rps']:.2f}")  # fmt: skip
                print(" ".join(f"{c:>10}" for c in cells), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"slo_ttft_s": args.slo_ttft, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
