"""bench/hook_cost.py against several source trees, interleaved round by round, with paired ratios.

Each tree is a checkout with its own `.venv` (e.g. a `git worktree` at an older commit), or without
one an export of a commit with the same dependencies as this tree (`git archive COMMIT | tar -x -C DIR`),
which then runs on this tree's venv. The one harness file, this tree's bench/hook_cost.py (copied when the
run starts), runs in every tree: the tree's python runs the file with the tree first on `sys.path`, so
each tree's kvgate code (addon, policy, store, and bench.overhead's request bodies) is measured by the
same measurement code.

On a shared machine the CPU time of the same work moves by ±20 % from one second to the next (other
processes' cache and memory traffic, the host's), far more than a few per cent of code change, and also
between runs minutes apart. So the trees are not measured one after the other: a batch starts one
process per tree (`bench.hook_cost --serve`: set up and warmed up, then idle), and then drives rounds
of `--requests` requests through them in turn, in an order that reverses every round (A B, B A, ...),
so each tree's round has a neighbour of every other tree's taken within about a second, and a drift of
the machine's speed falls on each tree alike. A round's figure is its process CPU per request (its
requests and the drain of their background work: bench/hook_cost.py). Against the first tree each
round of another tree gives one ratio, to the first tree's round of the same turn; reported: the median
of those ratios with a distribution-free 95 % interval (order statistics of the binomial, no
assumption about the noise's shape), and the ratio of the trees' median and 10th-percentile rounds.
`--batches` restarts the processes (new embedded Redis, new heap) that many times.

Run it under the shared lock, as one job, so the trees see the same machine:

    flock /tmp/kvgate-heavy.lock .venv/bin/python -m bench.hook_cost_ab \\
        --tree base=/work/wt/base-28ef --tree head=. [--batches 6 --rounds 20 --requests 300] [--json F]

The same tree named twice (`--tree a=. --tree b=.`) measures the method's own spread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from bench.stats import percentile

HARNESS = Path(__file__).with_name("hook_cost.py")
RUNNER = (
    "import runpy, sys; sys.path.insert(0, sys.argv[1]); harness = sys.argv[2]; "
    "sys.argv = [harness, *sys.argv[3:]]; runpy.run_path(harness, run_name='__main__')"
)


def python_of(tree: Path) -> str:
    """The tree's own `.venv/bin/python`, else this one (a tree exported without a venv: the tree comes
    first on `sys.path`, ahead of the editable install's finder, so its code is what runs)."""
    own = tree / ".venv" / "bin" / "python"
    return str(own) if own.exists() else sys.executable


def start(tree: Path, harness: Path, args: argparse.Namespace) -> subprocess.Popen[str]:
    cmd = [
        python_of(tree), "-c", RUNNER, str(tree), str(harness), "--serve",
        "--requests", str(args.requests), "--concurrency", str(args.concurrency), "--gc", args.gc,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    return subprocess.Popen(
        cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, bufsize=1,
    )  # fmt: skip


def read_line(proc: subprocess.Popen[str]) -> str:
    out: IO[str] | None = proc.stdout
    assert out is not None
    line = out.readline()
    if not line:
        raise RuntimeError(f"harness exited early (code {proc.wait()}): {proc.args!r}")
    return line.strip()


def one_round(proc: subprocess.Popen[str]) -> list[float]:
    """(CPU, user, system) µs per request of one round."""
    assert proc.stdin is not None
    proc.stdin.write("round\n")
    proc.stdin.flush()
    return [float(x) for x in read_line(proc).split()]


def batch(
    trees: list[tuple[str, Path]], harness: Path, args: argparse.Namespace
) -> dict[str, list[list[float]]]:
    """One process per tree, `args.rounds` rounds each, the trees' turns alternating in order."""
    procs = {name: start(tree, harness, args) for name, tree in trees}
    try:
        for proc in procs.values():
            if (line := read_line(proc)) != "ready":
                raise RuntimeError(f"harness said {line!r}, not 'ready'")
        out: dict[str, list[list[float]]] = {name: [] for name, _ in trees}
        for r in range(args.rounds):
            for name, _ in trees if r % 2 == 0 else trees[::-1]:
                out[name].append(one_round(procs[name]))
        return out
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs.values():
            if proc.wait(timeout=60) != 0:
                raise RuntimeError(f"harness failed (code {proc.returncode}): {proc.args!r}")


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


def summarize(
    names: list[str], rounds: dict[str, list[float]], batches: dict[str, list[float]], per_batch: int = 0
) -> dict[str, object]:
    """Per tree: its rounds' median, mean, p10, spread; its batches' medians; against the first tree the
    paired ratios (round by round) and the ratios of the medians and of the 10th percentiles.

    The rounds of one batch share their processes, so they are not independent: the pooled interval is
    too narrow when batches differ (docs/BENCHMARKS.md, session 8). With `per_batch` (rounds per batch)
    each batch's paired median is also reported, with their mean and its standard error: the figure to
    judge a difference by."""
    ref = names[0]
    trees: dict[str, object] = {}
    for n in names:
        v = sorted(rounds[n])
        med = statistics.median(v)
        entry: dict[str, object] = {
            "rounds": len(v), "median": med, "mean": statistics.fmean(v), "p10": percentile(v, 10),
            "p90": percentile(v, 90), "min": v[0], "max": v[-1],
            "p10_p90_spread_pct": 100 * (percentile(v, 90) - percentile(v, 10)) / med,
            "batch_medians": batches[n],
        }  # fmt: skip
        if n != ref:
            ratios = [b / a for a, b in zip(rounds[ref], rounds[n], strict=True)]
            lo, hi = median_interval(ratios)
            entry.update(
                paired_ratio_median=statistics.median(ratios), paired_ratio_ci95=[lo, hi],
                ratio_of_medians=med / statistics.median(rounds[ref]),
                ratio_of_p10=percentile(v, 10) / percentile(sorted(rounds[ref]), 10),
                ratio_of_means=statistics.fmean(v) / statistics.fmean(rounds[ref]),
            )  # fmt: skip
            if per_batch > 0:
                per = [statistics.median(ratios[i : i + per_batch]) for i in range(0, len(ratios), per_batch)]
                se = statistics.stdev(per) / math.sqrt(len(per)) if len(per) > 1 else math.nan
                entry.update(
                    batch_paired_medians=per, batch_paired_mean=statistics.fmean(per), batch_paired_se=se
                )
        trees[n] = entry
    return {"trees": trees}


def render(names: list[str], summary: dict[str, object]) -> str:
    trees = summary["trees"]
    assert isinstance(trees, dict)
    lines = [
        f"{'tree':<10} {'rounds':>6} {'median':>7} {'mean':>7} {'p10':>7} {'p90':>7}  (µs CPU/request)   "
        f"against {names[0]}: paired ratio median [95 % interval], ratio of medians, of p10s"
    ]
    for n in names:
        e = trees[n]
        line = f"{n:<10} {e['rounds']:6d} {e['median']:7.0f} {e['mean']:7.0f} {e['p10']:7.0f} {e['p90']:7.0f}"
        if "paired_ratio_median" in e:
            lo, hi = e["paired_ratio_ci95"]
            line += (
                f"   {e['paired_ratio_median']:.3f} [{lo:.3f}, {hi:.3f}], {e['ratio_of_medians']:.3f}, "
                f"{e['ratio_of_p10']:.3f}"
            )
        lines.append(line)
        if "batch_paired_medians" in e:
            lines.append(
                f"  {n} per-batch paired medians: "
                + ", ".join(f"{x:.3f}" for x in e["batch_paired_medians"])
                + f"; mean {e['batch_paired_mean']:.3f} ± {e['batch_paired_se']:.3f} (standard error)"
            )
    lines += [
        f"  {n} batch medians: " + ", ".join(f"{x:.0f}" for x in trees[n]["batch_medians"]) for n in names
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.hook_cost_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tree", action="append", required=True, metavar="NAME=PATH",
        help="a tree to measure (its own .venv, else this one's); the first is the reference",
    )  # fmt: skip
    parser.add_argument("--batches", type=int, default=6, help="process sets started, one after the other")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per tree in each batch")
    parser.add_argument("--requests", type=int, default=300, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--gc", choices=("freeze", "on", "off"), default="freeze")
    parser.add_argument("--json", type=Path, help="write every round and the summary here")
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
    rounds: dict[str, list[float]] = {n: [] for n in names}
    user_system: dict[str, list[list[float]]] = {n: [] for n in names}  # per round: user, system µs/request
    batch_medians: dict[str, list[float]] = {n: [] for n in names}
    load_before, started = os.getloadavg()[0], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hook-cost-ab-") as tmp:
        harness = Path(tmp) / "hook_cost.py"  # a copy: editing this tree during the run changes nothing
        shutil.copyfile(HARNESS, harness)
        for b in range(args.batches):
            got = batch(trees if b % 2 == 0 else trees[::-1], harness, args)  # who starts first alternates
            for n in names:
                rounds[n] += [r[0] for r in got[n]]
                user_system[n] += [r[1:] for r in got[n]]
                batch_medians[n].append(statistics.median(r[0] for r in got[n]))
            print(
                f"batch {b + 1}: " + ", ".join(f"{n} {batch_medians[n][-1]:.0f}" for n in names), flush=True
            )
    summary = summarize(names, rounds, batch_medians, per_batch=args.rounds)
    summary.update(load_average=[load_before, os.getloadavg()[0]], seconds=time.monotonic() - started)
    print(render(names, summary))
    print(f"load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}, {summary['seconds']:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {**vars(args), "json": str(args.json)},
                    "rounds": rounds,
                    "user_system": user_system,
                    **summary,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
