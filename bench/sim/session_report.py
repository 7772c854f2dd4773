"""Session affinity on the grid: `kvgate_session` (clients send session ids) against `kvgate` (they do
not), cell by cell, on the cells whose workload has sessions (the WEKA conversations).

    python -m bench.sim.session_report out/grid/grid.json

Prints, over those cells: kvgate_session's TTFT p99 and p50 ÷ kvgate's (worst, median, best; cells
better / worse), the hit-rate change, both policies' p99 ÷ the best peer (grid_report's definition),
and what the sessions did (policy.session.outcome counts, summed).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim.grid_report import summarise


def _run(cell: dict[str, Any], policy: str) -> dict[str, Any] | None:
    return next((r for r in cell["runs"] if r["policy"] == policy and not r.get("error")), None)


def report(document: dict[str, Any]) -> str:
    cells = []
    outcomes: dict[str, int] = {}
    for cell in document["cells"]:
        mine, base = _run(cell, "kvgate_session"), _run(cell, "kvgate")
        if mine is None or base is None or not mine["metrics"].get("session_outcomes"):
            continue
        for k, v in mine["metrics"]["session_outcomes"].items():
            outcomes[k] = outcomes.get(k, 0) + v
        cells.append((cell, mine["metrics"], base["metrics"]))
    if not cells:
        return "no cell has sessions (kvgate_session with session outcomes)"
    p99 = [m["ttft_p99"] / b["ttft_p99"] for _, m, b in cells]
    p50 = [m["ttft_p50"] / b["ttft_p50"] for _, m, b in cells]
    hit = [m["hit_rate"] - b["hit_rate"] for _, m, b in cells]
    peers = summarise([c for c, _, _ in cells], ["kvgate", "kvgate_session"])
    total = sum(outcomes.values())
    workloads = sorted({c["workload"] for c, _, _ in cells})
    lines = [
        f"session affinity: {len(cells)} cells with sessions ({', '.join(workloads)})",
        f"kvgate_session ÷ kvgate TTFT p99: worst {max(p99):.3f}, median {statistics.median(p99):.3f}, "
        f"best {min(p99):.3f}; better in {sum(r < 0.999 for r in p99)}, "
        f"worse in {sum(r > 1.001 for r in p99)}",
        f"kvgate_session ÷ kvgate TTFT p50: worst {max(p50):.3f}, median {statistics.median(p50):.3f}",
        f"hit rate change: mean {statistics.mean(hit):+.4f}, min {min(hit):+.4f}, max {max(hit):+.4f}",
    ]
    for policy in ("kvgate", "kvgate_session"):
        s = peers[policy]
        lines.append(
            f"{policy:<15} p99 ÷ best peer: worst {s['p99_ratio_worst']:.2f}, "
            f"median {s['p99_ratio_median']:.2f}, "
            f"cells worse than the best peer {s['cells_worse_than_best_peer']}"
        )
    shares = ", ".join(f"{k} {v} ({v / total:.1%})" for k, v in sorted(outcomes.items()))
    lines.append(f"session outcomes over {total} requests: {shares}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m bench.sim.session_report GRID_JSON", file=sys.stderr)
        return 2
    print(report(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
