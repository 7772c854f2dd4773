"""The robustness grid's verdict: per-policy summary over cells, the console table, and the heatmap.

For a policy P in a cell, its reference is the best *other* policy there, kvgate's own variants excluded
(the policies of bench/sim/policy_router.py: `kvgate`, `article`, and any `kvgate*`), so kvgate is judged
against peers only and a peer is never judged against kvgate. Per policy, over the cells where P and a
reference ran:
  p99_ratio_worst / _median      max / median of P's TTFT p99 ÷ the lowest reference TTFT p99
  cells_worse_than_best_peer     cells where that ratio is > 1
  p50_ratio_worst                max of P's TTFT p50 ÷ the lowest reference TTFT p50
  hit_over_pooled_median         median of P's hit rate ÷ the cell's pooled-LRU hit-rate bound
  slowdown_p99_best_share        share of cells where P's slowdown p99 is <= every reference's
  flap_rate_worst                max of P's flap_rate
Medians interpolate (statistics.median); a policy with no usable cell gets nulls.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim.registry import POLICIES, run_name

SUMMARY_KEYS = (
    "p99_ratio_worst",
    "p99_ratio_median",
    "cells_worse_than_best_peer",
    "p50_ratio_worst",
    "hit_over_pooled_median",
    "slowdown_p99_best_share",
    "flap_rate_worst",
)


def is_kvgate_variant(policy: str) -> bool:
    """kvgate's own policies: run by bench/sim/policy_router.py, or named kvgate*."""
    return policy.startswith("kvgate") or POLICIES.get(policy, "").startswith("bench.sim.policy_router:")


def _metric(run: dict[str, Any], key: str) -> float | None:
    if run.get("error"):
        return None
    value = run.get("metrics", {}).get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def _best_reference(runs: Sequence[dict[str, Any]], policy: str, key: str) -> float | None:
    values = [
        v
        for r in runs
        if run_name(r) != policy and not is_kvgate_variant(r["policy"])
        for v in [_metric(r, key)]
        if v is not None
    ]
    return min(values) if values else None


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    if reference <= 0:
        return 1.0 if value <= 0 else math.inf
    return value / reference


def cell_ratios(cell: dict[str, Any], policy: str) -> dict[str, float | None]:
    """P's ratios in one cell (None where P or every reference lacks the metric)."""
    runs = cell["runs"]
    mine = next((r for r in runs if run_name(r) == policy), None)
    if mine is None:
        return dict.fromkeys(("p99", "p50", "hit", "slowdown_best", "flap"))
    pooled = cell.get("bounds", {}).get("pooled_lru_hit_rate")
    hit = _metric(mine, "hit_rate")
    slowdown, best_slowdown = _metric(mine, "slowdown_p99"), _best_reference(runs, policy, "slowdown_p99")
    return {
        "p99": _ratio(_metric(mine, "ttft_p99"), _best_reference(runs, policy, "ttft_p99")),
        "p50": _ratio(_metric(mine, "ttft_p50"), _best_reference(runs, policy, "ttft_p50")),
        "hit": hit / pooled if hit is not None and pooled else None,
        "slowdown_best": (
            None if slowdown is None else 1.0 if best_slowdown is None or slowdown <= best_slowdown else 0.0
        ),
        "flap": _metric(mine, "flap_rate"),
    }


def summarise(cells: Sequence[dict[str, Any]], policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """grid.json `summary`: per policy, SUMMARY_KEYS (see module docstring)."""
    summary: dict[str, dict[str, Any]] = {}
    for policy in policies:
        per_cell = [cell_ratios(c, policy) for c in cells]

        def values(key: str, rows: list[dict[str, float | None]] = per_cell) -> list[float]:
            return [v for r in rows if (v := r[key]) is not None]

        p99, p50, hit = values("p99"), values("p50"), values("hit")
        best, flap = values("slowdown_best"), values("flap")
        summary[policy] = {
            "p99_ratio_worst": max(p99) if p99 else None,
            "p99_ratio_median": statistics.median(p99) if p99 else None,
            "cells_worse_than_best_peer": sum(v > 1.0 for v in p99),
            "p50_ratio_worst": max(p50) if p50 else None,
            "hit_over_pooled_median": statistics.median(hit) if hit else None,
            "slowdown_p99_best_share": statistics.fmean(best) if best else None,
            "flap_rate_worst": max(flap) if flap else None,
            "cells": len(p99),
        }
    return summary


def grid_document(
    cells: list[dict[str, Any]], policies: Sequence[str], meta: dict[str, Any]
) -> dict[str, Any]:
    """The grid.json object: {"cells": [...], "summary": {...}} plus `meta` (how it was run)."""
    return {"cells": cells, "summary": summarise(cells, policies), "meta": meta}


def _fmt(value: object, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def format_summary(document: dict[str, Any]) -> str:
    """One row per policy: the summary numbers (ratios to the best other non-kvgate policy per cell)."""
    columns = (
        ("p99_ratio_worst", "p99/best worst", ".2f"),
        ("p99_ratio_median", "p99/best median", ".2f"),
        ("cells_worse_than_best_peer", "cells >1", "d"),
        ("p50_ratio_worst", "p50/best worst", ".2f"),
        ("hit_over_pooled_median", "hit/pooled median", ".3f"),
        ("slowdown_p99_best_share", "slowdown best share", ".0%"),
        ("flap_rate_worst", "flap worst", ".1%"),
    )
    cells = len(document["cells"])
    rows = [["policy", *(title for _, title, _ in columns)]]
    for policy, s in document["summary"].items():
        rows.append([policy, *(_fmt(s.get(key), spec) for key, _, spec in columns)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    head = f"robustness grid: {cells} cells; ratios to the best other policy (kvgate's variants excluded)"
    body = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return "\n".join([head, *body])


def plot_heatmap(path: Path, document: dict[str, Any]) -> None:
    """grid_p99_ratio.png: log2(TTFT p99 ÷ best other policy) per policy (rows) and cell (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = document["cells"]
    policies = list(document["summary"])
    data = np.full((len(policies), len(cells)), np.nan)
    for j, cell in enumerate(cells):
        for i, policy in enumerate(policies):
            ratio = cell_ratios(cell, policy)["p99"]
            if ratio is not None and ratio > 0 and math.isfinite(ratio):
                data[i, j] = math.log2(ratio)
    width = min(60.0, max(8.0, 0.06 * len(cells) + 3))
    fig, ax = plt.subplots(figsize=(width, 0.45 * len(policies) + 2.2))
    image = ax.imshow(data, aspect="auto", cmap="RdBu_r", vmin=-3, vmax=3, interpolation="nearest")
    ax.set_yticks(range(len(policies)), policies)
    # one tick per workload block: cells are ordered workload, workers, seed, load
    starts = [j for j, c in enumerate(cells) if j == 0 or c["workload"] != cells[j - 1]["workload"]]
    ax.set_xticks(starts, [cells[j]["workload"] for j in starts], rotation=45, ha="left", fontsize=8)
    for j in starts[1:]:
        ax.axvline(j - 0.5, color="black", linewidth=0.6)
    ax.set_xlabel("cells (per workload: workers, seed, load ascending)")
    ax.set_title("TTFT p99 ÷ best other policy (log2; red = worse, blue = better)")
    fig.colorbar(image, ax=ax, label="log2 ratio")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_by_workload(document: dict[str, Any], policy: str = "kvgate") -> str:
    """`policy` per workload: worst and median p99 ratio, cells worse than the best peer, worst p50
    ratio, median hit ÷ pooled bound, worst flap_rate (same definitions as the summary)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for c in document["cells"]:
        by.setdefault(c["workload"], []).append(c)
    rows = [
        ["workload", "cells", "p99/best worst", "median", ">1", "p50/best worst", "hit/pooled", "flap worst"]
    ]
    for workload, cells in by.items():
        s = summarise(cells, [policy])[policy]
        rows.append(
            [
                workload,
                str(len(cells)),
                _fmt(s["p99_ratio_worst"], ".2f"),
                _fmt(s["p99_ratio_median"], ".2f"),
                str(s["cells_worse_than_best_peer"]),
                _fmt(s["p50_ratio_worst"], ".2f"),
                _fmt(s["hit_over_pooled_median"], ".3f"),
                _fmt(s["flap_rate_worst"], ".1%"),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    body = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return "\n".join([f"{policy} per workload:", *body])
