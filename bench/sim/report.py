"""Output of `kvgate bench sim`: the console table, results.json / sweep.json, and PNG plots.

Plots (matplotlib, Agg backend, no display needed): ttft_cdf.png (TTFT CDF per policy, log x),
hit_rate.png (token hit rate per policy against the infinite-cache and pooled-LRU bounds),
load_over_time.png (requests in flight per worker over the run, one panel per policy),
sweep_ttft_p99.png (TTFT p99 against offered load per policy, with --sweep).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim.runner import PolicyRun

TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("hit_rate", "hit", "{:.1%}"),
    ("ttft_p50", "ttft p50", "{:.3f}"),
    ("ttft_p90", "p90", "{:.3f}"),
    ("ttft_p99", "p99", "{:.3f}"),
    ("e2e_p50", "e2e p50", "{:.2f}"),
    ("e2e_p99", "p99", "{:.2f}"),
    ("queue_p50", "queue p50", "{:.3f}"),
    ("queue_p99", "p99", "{:.3f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("throughput_tok_s", "tok/s", "{:.0f}"),
    ("util_cv", "util cv", "{:.3f}"),
    ("switch_rate", "switch", "{:.1%}"),
    ("flap_rate", "flap", "{:.1%}"),
    ("slowdown_p99", "slow p99", "{:.1f}"),
)


def _cell(value: object, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def format_table(document: dict[str, object]) -> str:
    """The run as an aligned text table, headed by the workload and its bounds (times in seconds)."""
    bounds = document["bounds"]
    assert isinstance(bounds, dict)
    head = (
        f"{document['trace']}: {document.get('requests')} requests, {document['workers']} workers, "
        f"load {document['load']}, profile {document.get('profile')}, "
        f"cache pressure {float(document.get('cache_pressure', 0.0)):.2f}x one worker\n"  # type: ignore[arg-type]
        f"bounds: infinite-cache hit {bounds['infinite_hit_rate']:.1%}, "
        f"pooled-LRU hit {bounds['pooled_lru_hit_rate']:.1%}   (times in s)"
    )
    rows = [[title for _, title, _ in TABLE_COLUMNS]]
    runs = document["runs"]
    assert isinstance(runs, list)
    for run in runs:
        if run.get("error"):
            rows.append([run["policy"], f"FAILED: {run['error']}"])
            continue
        metrics = run["metrics"]
        label = run["policy"] if run.get("admission") is None else f"{run['policy']} [{run['admission']}]"
        if run.get("index") is not None:
            label += f" ({run['index']} index)"
        rows.append([label] + [_cell(metrics.get(key), fmt) for key, _, fmt in TABLE_COLUMNS[1:]])
    widths = [
        max(len(r[i]) for r in rows if len(r) > i and len(r) == len(rows[0])) for i in range(len(rows[0]))
    ]
    lines = [head]
    for r in rows:
        if len(r) != len(widths):
            lines.append("  ".join(r))
        else:
            lines.append(
                "  ".join(
                    c.ljust(w) if i == 0 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=False))
                )
            )
    return "\n".join(lines)


ADMISSION_COLUMNS = (
    ("goodput", "goodput", "{:.1%}"),
    ("high.ttft_p50", "high p50", "{:.3f}"),
    ("high.ttft_p99", "p99", "{:.3f}"),
    ("high_ttft_p99_at_half_load", "p99@0.5", "{:.3f}"),
    ("high.rejected", "rej", "{}"),
    ("normal.ttft_p50", "normal p50", "{:.3f}"),
    ("normal.ttft_p99", "p99", "{:.3f}"),
    ("normal.rejected", "rej", "{}"),
    ("low.ttft_p50", "low p50", "{:.2f}"),
    ("low.ttft_p99", "p99", "{:.2f}"),
    ("low.completed", "done", "{}"),
    ("low.rejected", "rej", "{}"),
    ("low.max_wait", "max wait", "{:.1f}"),
)


def _metric(metrics: dict[str, Any], key: str) -> object:
    if "." in key:
        band, name = key.split(".")
        return metrics.get("by_priority", {}).get(band, {}).get(name)
    return metrics.get(key)


def format_admission_table(document: dict[str, object]) -> str:
    """Per (policy, admission) run: goodput, per-band TTFT / rejections, low-band completions and
    longest admission wait, and the high-band TTFT p99 of the same pair at half load (times in s)."""
    rows = [["policy", "admission"] + [title for _, title, _ in ADMISSION_COLUMNS]]
    runs = document["runs"]
    assert isinstance(runs, list)
    for run in runs:
        if run.get("error"):
            continue
        metrics = run["metrics"]
        rows.append(
            [run["policy"], str(run.get("admission", "-"))]
            + [_cell(_metric(metrics, key), fmt) for key, _, fmt in ADMISSION_COLUMNS]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    )


def write_json(path: Path, document: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _line_style(policy: str, index: int) -> dict[str, Any]:
    """Distinct colours for up to 20 policies (tab10 repeats after 10); kvgate drawn bold in black."""
    if policy.startswith("kvgate"):
        return {"color": "black", "lw": 2.2, "zorder": 5}
    return {"color": _PALETTE[index % len(_PALETTE)], "lw": 1.1, "ls": "-" if index < 10 else "--"}


_PALETTE = [f"tab:{c}" for c in ("blue", "orange", "green", "red", "purple", "brown", "pink", "gray",
                                  "olive", "cyan")]  # fmt: skip


def plot_run(out_dir: Path, document: dict[str, object], runs: Sequence[PolicyRun]) -> list[Path]:
    """TTFT CDF, hit rate vs bounds, load over time; returns the files written."""
    plt = _pyplot()
    ok = [r for r in runs if not r.error]
    written = []
    title = f"{document['trace']} · {document['workers']} workers · load {document['load']}"

    fig, ax = plt.subplots(figsize=(8, 5))
    for index, run in enumerate(ok):
        xs = run.ttft_samples
        if xs:
            ax.plot(
                [max(x, 1e-4) for x in xs],
                [(i + 1) / len(xs) for i in range(len(xs))],
                label=_run_label(run),
                **_line_style(run.policy, index),
            )
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF\n{title}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    written.append(_save(fig, out_dir / "ttft_cdf.png", plt))

    bounds = document["bounds"]
    assert isinstance(bounds, dict)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [_run_label(r) for r in ok]
    ax.bar(names, [float(r.metrics.get("hit_rate", 0.0)) for r in ok], color="tab:blue")  # type: ignore[arg-type]
    ax.axhline(bounds["infinite_hit_rate"], color="tab:green", ls="--", label="infinite cache")
    ax.axhline(bounds["pooled_lru_hit_rate"], color="tab:red", ls=":", label="pooled LRU")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"Prefix hit rate against the trace's bounds\n{title}", fontsize=9)
    ax.tick_params(axis="x", rotation=45, labelsize=8)
    ax.legend(fontsize=8)
    written.append(_save(fig, out_dir / "hit_rate.png", plt))

    if ok:
        cols = min(3, len(ok))
        rows = math.ceil(len(ok) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 2.6 * rows), squeeze=False, sharey=True)
        for ax, run in zip(axes.flat, ok, strict=False):
            for wid, values in run.load_inflight.items():
                ax.plot([i * run.load_period_s for i in range(len(values))], values, lw=0.8, label=wid)
            ax.set_title(_run_label(run), fontsize=9)
            ax.set_xlabel("time (s)", fontsize=8)
            ax.set_ylabel("in flight", fontsize=8)
        for ax in list(axes.flat)[len(ok) :]:
            ax.axis("off")
        fig.suptitle(f"Requests in flight per worker\n{title}", fontsize=9)
        written.append(_save(fig, out_dir / "load_over_time.png", plt))
    return written


def _run_label(run: PolicyRun) -> str:
    return run.policy if run.admission is None else f"{run.policy} [{run.admission}]"


def sweep_document(
    trace: str, workers: int, loads: Sequence[float], documents: Sequence[dict[str, object]]
) -> dict[str, object]:
    """sweep.json: per policy, TTFT p99 / p50 and hit rate at each offered load."""
    policies: dict[str, dict[str, list[float | None]]] = {}
    for doc in documents:
        for run in doc["runs"]:  # type: ignore[attr-defined]
            entry = policies.setdefault(run["policy"], {"ttft_p99": [], "ttft_p50": [], "hit_rate": []})
            for key in entry:
                entry[key].append(run["metrics"].get(key))
    return {"trace": trace, "workers": workers, "loads": list(loads), "policies": policies}


def format_sweep(sweep: dict[str, object]) -> str:
    loads = sweep["loads"]
    assert isinstance(loads, list)
    header = ["TTFT p99 (s)"] + [f"load {x:g}" for x in loads]
    rows = [header]
    for policy, entry in sweep["policies"].items():  # type: ignore[attr-defined]
        rows.append([policy] + [_cell(v, "{:.3f}") for v in entry["ttft_p99"]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))
        )
        for r in rows
    )


def plot_sweep(out_dir: Path, sweep: dict[str, object]) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    loads = sweep["loads"]
    for index, (policy, entry) in enumerate(sweep["policies"].items()):  # type: ignore[attr-defined]
        points = [(x, y) for x, y in zip(loads, entry["ttft_p99"], strict=False) if y is not None]  # type: ignore[call-overload]
        style = _line_style(policy, index)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy, **style)
    ax.set_yscale("log")
    ax.set_xlabel("offered load (fraction of cluster capacity, no cache hits)")
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_title(f"TTFT p99 against offered load\n{sweep['trace']} · {sweep['workers']} workers", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out_dir / "sweep_ttft_p99.png", plt)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
