"""Live against simulated: each router's rank and ratios in `kvgate bench live` next to its model's in
`kvgate bench sim`, on the very same requests and engine settings (issue 11, item 2).

    python -m bench.live_vs_sim out/live/results.json [more results.json ...] [--markdown]

For every (workload, load) of the live results it replays the trace the live run wrote
(trace-<workload>-<load>.jsonl) in the simulator with the live run's engine profile (profile.toml:
the workers' --profile and --num-gpu-blocks) and worker count, one run per simulated model:

  kvgate, kvgate_x2 -> kvgate          sglang -> sglang (bench/peers/sglang.py)
  smg -> smg (bench/peers/smg.py: SGLang's match + SMG's worker overload protection and spill gate)
  vllm_router -> vllm_router (bench/peers/vllm_router.py)
  dynamo_select -> dynamo              round_robin -> round_robin

and prints, per router: live (mean of the passes) and simulated TTFT p50/p99, hit rate, throughput
and goodput (TTFT within the live run's SLO, per second), the ratio to the best *peer* (smg, sglang,
vllm_router, dynamo_select) live and simulated, the rank by TTFT p99 live and simulated, and the gap =
simulated / live. Percentiles: live nearest-rank, sim linear.

`--replays K --jitter-ms J` replays the trace K times, replay k with every arrival delayed by a
uniform [0, J] ms drawn from seed k (replay 0 of `--jitter-ms 0` is the trace as written), and reports
the mean over the replays and the range of goodput. One deterministic replay is one draw: on the
session-9 tenants 2x trace a 2 ms delay of the live client's sends already flips which worker the
SGLang model's first request of a hot tenant lands on, and with it the run's goodput (19 or 27 req/s,
docs/BENCHMARKS.md §99); the live passes land on either side too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.hit_value import delayed, summary
from bench.sim.cluster import simulate as simulate_run
from bench.sim.metrics import compute_metrics
from bench.sim.profiles import load_profile
from bench.sim.registry import make_router
from bench.sim.runner import prepare_workload
from bench.sim.traces import load_trace

SIM_MODEL = {
    "kvgate": "kvgate",
    "kvgate_x2": "kvgate",
    "smg": "smg",
    "sglang": "sglang",
    "vllm_router": "vllm_router",
    "dynamo_select": "dynamo",
    "round_robin": "round_robin",
}
PEERS = ("smg", "sglang", "vllm_router", "dynamo_select")
METRICS = ("ttft_p50", "ttft_p99", "hit_rate", "throughput_rps", "goodput_rps")


def live_means(runs: Sequence[dict[str, object]]) -> dict[str, dict[str, float]]:
    """router -> metric -> mean over the passes."""
    out: dict[str, dict[str, float]] = {}
    for router in dict.fromkeys(str(r["router"]) for r in runs):
        mine = [r for r in runs if r["router"] == router]
        out[router] = {m: statistics.fmean(float(r[m]) for r in mine) for m in METRICS}  # type: ignore[arg-type]
        good = [float(r["goodput_rps"]) for r in mine]  # type: ignore[arg-type]
        out[router] |= {"goodput_rps_min": min(good), "goodput_rps_max": max(good)}
    return out


def simulate(
    trace: Path, profile: Path, workers: int, load: float, models: Sequence[str],
    slo_s: float = 2.0, replays: int = 1, jitter_s: float = 0.0,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """model -> metric -> mean over the replays (and goodput_rps_min / _max, their range)."""
    engine = load_profile(profile)
    workload = prepare_workload(str(trace), load_trace(trace), engine, workers, load)
    out = {}
    for model in dict.fromkeys(models):
        runs = []
        for k in range(replays):
            requests = delayed(workload.requests, jitter_s, k)
            result = simulate_run(requests, make_router(model, 1), engine, workers)
            metrics = compute_metrics(result, requests, engine)
            rates = summary(result, slo_s)
            runs.append({**{m: float(metrics[m]) for m in METRICS[:3]}, "throughput_rps": rates["rps"],  # type: ignore[arg-type]
                         "goodput_rps": rates["good"]})  # fmt: skip
        out[model] = {m: statistics.fmean(r[m] for r in runs) for m in METRICS}
        good = [r["goodput_rps"] for r in runs]
        out[model] |= {"goodput_rps_min": min(good), "goodput_rps_max": max(good)}
    return out


def ratio(value: float, best: float) -> float:
    return value / best if best else float("nan")


def compare(live: dict[str, dict[str, float]], sim: dict[str, dict[str, float]]) -> list[dict[str, object]]:
    routers = list(live)
    peers = [r for r in routers if r in PEERS]
    rows = []
    live_rank = {r: i + 1 for i, r in enumerate(sorted(routers, key=lambda r: live[r]["ttft_p99"]))}
    sim_of = {r: sim[SIM_MODEL[r]] for r in routers}
    sim_rank = {r: i + 1 for i, r in enumerate(sorted(routers, key=lambda r: sim_of[r]["ttft_p99"]))}
    for r in routers:
        row: dict[str, object] = {
            "router": r,
            "model": SIM_MODEL[r],
            "live_rank": live_rank[r],
            "sim_rank": sim_rank[r],
        }
        for m in METRICS:
            row[f"live_{m}"] = live[r][m]
            row[f"sim_{m}"] = sim_of[r][m]
            row[f"gap_{m}"] = ratio(sim_of[r][m], live[r][m])
        for side, src in (("live", live[r]), ("sim", sim_of[r])):
            row[f"{side}_goodput_min"], row[f"{side}_goodput_max"] = (
                src["goodput_rps_min"],
                src["goodput_rps_max"],
            )
        for m in ("ttft_p50", "ttft_p99"):
            if peers:
                row[f"live_{m}_vs_best_peer"] = ratio(live[r][m], min(live[p][m] for p in peers))
                row[f"sim_{m}_vs_best_peer"] = ratio(sim_of[r][m], min(sim_of[p][m] for p in peers))
        rows.append(row)
    return rows


def format_rows(title: str, rows: Sequence[dict[str, object]], markdown: bool) -> str:
    head = ["router", "sim model", "live p50", "sim p50", "live p99", "sim p99", "live hit", "sim hit",
            "live req/s", "sim", "live goodput (range)", "sim goodput (range)",
            "p50/best peer live", "sim", "p99/best peer live", "sim", "rank live", "sim"]  # fmt: skip
    lines = []
    for r in rows:
        g = r.get
        lines.append([
            str(r["router"]), str(r["model"]),
            f"{g('live_ttft_p50'):.3f}", f"{g('sim_ttft_p50'):.3f}",
            f"{g('live_ttft_p99'):.3f}", f"{g('sim_ttft_p99'):.3f}",
            f"{g('live_hit_rate'):.1%}", f"{g('sim_hit_rate'):.1%}",
            f"{g('live_throughput_rps'):.2f}", f"{g('sim_throughput_rps'):.2f}",
            f"{g('live_goodput_rps'):.2f} ({g('live_goodput_min'):.2f}-{g('live_goodput_max'):.2f})",
            f"{g('sim_goodput_rps'):.2f} ({g('sim_goodput_min'):.2f}-{g('sim_goodput_max'):.2f})",
            f"{g('live_ttft_p50_vs_best_peer', float('nan')):.2f}x",
            f"{g('sim_ttft_p50_vs_best_peer', float('nan')):.2f}x",
            f"{g('live_ttft_p99_vs_best_peer', float('nan')):.2f}x",
            f"{g('sim_ttft_p99_vs_best_peer', float('nan')):.2f}x",
            str(r["live_rank"]), str(r["sim_rank"]),
        ])  # fmt: skip
    if markdown:
        out = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = [title, "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live_vs_sim", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="results.json of kvgate bench live")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", type=Path, help="write the comparison rows here")
    p.add_argument("--replays", type=int, default=1, help="simulated replays per model (default 1)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="max send delay per request and replay")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    every = []
    for path in args.results:
        doc = json.loads(path.read_text())
        profile = Path(doc["profile"])
        for workload, load in dict.fromkeys((r["workload"], r["load"]) for r in doc["runs"]):
            runs = [r for r in doc["runs"] if (r["workload"], r["load"]) == (workload, load)]
            live = live_means(runs)
            trace = Path(doc.get("out", path.parent)) / f"trace-{workload}-{load:g}.jsonl"
            sim = simulate(
                trace, profile, int(doc["workers"]), float(load), [SIM_MODEL[r] for r in live],
                slo_s=float(doc.get("slo_ttft_s", 2.0)), replays=args.replays, jitter_s=args.jitter_ms / 1000,
            )  # fmt: skip
            rows = compare(live, sim)
            title = (
                f"{workload} at load {load:g} ({doc['workers']} workers, "
                f"{len(runs) // len(live)} passes live; "
                f"{args.replays} replays, send delay up to {args.jitter_ms:g} ms)"
            )
            print(format_rows(title, rows, args.markdown))
            print()
            every.append({"workload": workload, "load": load, "rows": rows})
    if args.json:
        args.json.write_text(json.dumps(every, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
