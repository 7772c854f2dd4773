"""bench/hook_cost.py against several source trees, interleaved process by process, with paired ratios.

Each tree is a checkout with its own `.venv` (e.g. a `git worktree` at an older commit). The one harness
file, this tree's bench/hook_cost.py, runs in every tree: its `.venv/bin/python` runs the file with the
tree first on `sys.path`, so the tree's kvgate code (addon, policy, store, bench.overhead's request
bodies) is measured by the same measurement code. A rotation runs every tree once, in an order that
reverses every other rotation (A B C, C B A, ...), so a drift of the machine's speed falls on each tree
alike; each run is `--rounds` rounds of `--requests` in one process, and its figure is the median of its
rounds (bench/hook_cost.py). Reported per tree: the runs' median, mean, minimum and spread; against the
first tree: the ratio of the medians and the median of the per-rotation ratios with a distribution-free
95 % interval (order statistics of the binomial, no assumption about the noise's shape).

Run it under the shared lock, as one job, so the trees see the same machine:

    flock /tmp/kvgate-heavy.lock .venv/bin/python -m bench.hook_cost_ab \\
        --tree base=/work/wt/base-28ef --tree head=. --rotations 20 [--json out.json]

The same tree named twice (`--tree a=. --tree b=.`) measures the method's own spread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HARNESS = Path(__file__).with_name("hook_cost.py")
RUNNER = (
    "import runpy, sys; sys.path.insert(0, sys.argv[1]); harness = sys.argv[2]; "
    "sys.argv = [harness, *sys.argv[3:]]; runpy.run_path(harness, run_name='__main__')"
)


def run_once(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, object]:
    python = tree / ".venv" / "bin" / "python"
    cmd = [
        str(python), "-c", RUNNER, str(tree), str(HARNESS),
        "--requests", str(args.requests), "--rounds", str(args.rounds), "--concurrency", str(args.concurrency),
        "--gc", args.gc, "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    result: dict[str, object] = json.loads(out.read_text())
    return result


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median: the k-th smallest and k-th largest values, with k the
    largest rank for which P(Binomial(n, ½) < k) ≤ (1 − confidence) / 2 (NaNs below 6 values)."""
    n = len(values)
    ordered = sorted(values)
    tail, k, cumulative = (1 - confidence) / 2, 0, 0.0
    while k < n:
        cumulative += math.comb(n, k) / 2**n
        if cumulative > tail:
            break
        k += 1
    if k == 0:
        return math.nan, math.nan
    return ordered[k - 1], ordered[n - k]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hook_cost_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                        help="a tree to measure (its own .venv); the first is the reference")  # fmt: skip
    parser.add_argument("--rotations", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run (bench.hook_cost --rounds)")
    parser.add_argument("--requests", type=int, default=500, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--gc", choices=("freeze", "on", "off"), default="freeze")
    parser.add_argument("--json", type=Path, help="write every run's rounds and the summary here")
    args = parser.parse_args(argv)
    trees: list[tuple[str, Path]] = []
    for spec in args.tree:
        name, _, path = spec.partition("=")
        if not path:
            parser.error(f"--tree {spec!r}: expected NAME=PATH")
        trees.append((name, Path(path).resolve()))
    names = [n for n, _ in trees]
    if len(set(names)) != len(names):
        parser.error("tree names must differ")
    runs: dict[str, list[float]] = {n: [] for n in names}
    raw: dict[str, list[dict[str, object]]] = {n: [] for n in names}
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hook-cost-ab-") as tmp:
        for rotation in range(args.rotations):
            order = trees if rotation % 2 == 0 else trees[::-1]
            for name, tree in order:
                result = run_once(tree, args, Path(tmp) / f"{name}.json")
                figure = float(result["median"])  # type: ignore[arg-type]
                runs[name].append(figure)
                raw[name].append(result)
            print(f"rotation {rotation + 1}: " + ", ".join(f"{n} {runs[n][-1]:.0f}" for n in names), flush=True)
    summary = summarize(names, runs)
    summary["load_average"] = [load_before, os.getloadavg()[0]]
    summary["seconds"] = time.monotonic() - started
    print(render(names, runs, summary))
    if args.json:
        args.json.write_text(json.dumps({"args": {**vars(args), "json": str(args.json)}, "runs": raw, **summary}))
    return 0


def summarize(names: list[str], runs: dict[str, list[float]]) -> dict[str, object]:
    ref = names[0]
    out: dict[str, object] = {"trees": {}}
    trees: dict[str, object] = {}
    for n in names:
        v = runs[n]
        med = statistics.median(v)
        entry: dict[str, object] = {
            "median": med, "mean": statistics.fmean(v), "min": min(v), "max": max(v),
            "spread_pct": 100 * (max(v) - min(v)) / med,
            "stdev_pct": 100 * statistics.stdev(v) / statistics.fmean(v) if len(v) > 1 else math.nan,
        }  # fmt: skip
        if n != ref:
            ratios = [b / a for a, b in zip(runs[ref], v, strict=True)]
            lo, hi = median_interval(ratios)
            entry.update(
                ratio_of_medians=med / statistics.median(runs[ref]),
                ratio_of_means=statistics.fmean(v) / statistics.fmean(runs[ref]),
                paired_ratio_median=statistics.median(ratios), paired_ratio_ci95=[lo, hi],
            )  # fmt: skip
        trees[n] = entry
    out["trees"] = trees
    return out


def render(names: list[str], runs: dict[str, list[float]], summary: dict[str, object]) -> str:
    trees = summary["trees"]
    assert isinstance(trees, dict)
    lines = [f"{'tree':<10} {'median':>7} {'mean':>7} {'min':>7} {'max':>7} {'spread':>7} {'sd':>6}   against "
             f"{names[0]}: median ratio, mean ratio, paired ratio median [95 % interval]"]  # fmt: skip
    for n in names:
        e = trees[n]
        line = (
            f"{n:<10} {e['median']:7.0f} {e['mean']:7.0f} {e['min']:7.0f} {e['max']:7.0f} "
            f"{e['spread_pct']:6.0f}% {e['stdev_pct']:5.1f}%"
        )
        if "paired_ratio_median" in e:
            lo, hi = e["paired_ratio_ci95"]
            line += (
                f"   {e['ratio_of_medians']:.3f}, {e['ratio_of_means']:.3f}, {e['paired_ratio_median']:.3f} "
                f"[{lo:.3f}, {hi:.3f}]"
            )
        lines.append(line)
    lines.append("runs (µs CPU/request, each the median of its rounds):")
    lines += [f"  {n}: " + ", ".join(f"{x:.0f}" for x in runs[n]) for n in names]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
