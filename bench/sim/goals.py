"""Issue-2 goal check over `kvgate bench sim` results: how kvgate's default stands against the peers.

    python -m bench.sim.goals out/conversation/results.json out/synthetic/results.json ...

For each results.json (one trace or scenario, all policies), prints kvgate's ratios to the goals:
TTFT p99 ≤ 0.8 × the best peer's; TTFT p50 ≤ the best peer's; hit rate ≥ 0.95 × the pooled-LRU
bound; util CV ≤ 1.25 × least_inflight's; hot-prefix switch rate < 2 %. "Peers" are every other
policy in the run, baselines included.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GOAL_P99_RATIO = 0.8
GOAL_HIT_OF_POOLED = 0.95
GOAL_UTIL_CV_RATIO = 1.25
GOAL_SWITCH_RATE = 0.02


def goal_rows(results: dict[str, object]) -> dict[str, object]:
    runs = {r["policy"]: r["metrics"] for r in results["runs"]}  # type: ignore[index, union-attr]
    kv = runs["kvgate"]
    peers = {name: m for name, m in runs.items() if name != "kvgate"}
    best_p99_name = min(peers, key=lambda n: peers[n]["ttft_p99"])
    best_p50_name = min(peers, key=lambda n: peers[n]["ttft_p50"])
    pooled = results["bounds"]["pooled_lru_hit_rate"]  # type: ignore[index]
    return {
        "trace": results["trace"],
        "p99_ratio": kv["ttft_p99"] / peers[best_p99_name]["ttft_p99"],
        "best_p99": best_p99_name,
        "p50_ratio": kv["ttft_p50"] / peers[best_p50_name]["ttft_p50"],
        "best_p50": best_p50_name,
        "hit_of_pooled": kv["hit_rate"] / pooled if pooled else float("nan"),
        "util_cv_ratio": kv["util_cv"] / runs["least_inflight"]["util_cv"]
        if runs.get("least_inflight", {}).get("util_cv")
        else float("nan"),
        "switch_rate": kv["switch_rate"],
    }


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(
        f"{'workload':<34} {'p99/best':>9} {'(best)':<15} {'p50/best':>9} {'(best)':<15}"
        f" {'hit/pooled':>10} {'cv/LI':>6} {'switch':>7}"
    )
    print(
        f"{'goal':<34} {'<= 0.80':>9} {'':<15} {'<= 1.00':>9} {'':<15} {'>= 0.95':>10} {'<=1.25':>6}"
        f" {'< 2%':>7}"
    )
    for path in argv:
        row = goal_rows(json.loads(Path(path).read_text()))
        name = str(row["trace"]).rsplit("/", 1)[-1]
        print(
            f"{name:<34} {row['p99_ratio']:>9.2f} {row['best_p99']!s:<15} {row['p50_ratio']:>9.2f}"
            f" {row['best_p50']!s:<15} {row['hit_of_pooled']:>10.2f} {row['util_cv_ratio']:>6.2f}"
            f" {row['switch_rate']:>7.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
