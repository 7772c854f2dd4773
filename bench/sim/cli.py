"""`kvgate bench sim`: replay a trace or a scenario against every selected routing policy, side by side.

  kvgate bench sim --trace ../shared/traces/mooncake_fast25/conversation_trace.jsonl --policies all
  kvgate bench sim --scenario multi_tenant --workers 8 --load 0.8 --out out/sim --sweep
  kvgate bench sim --scenario overload --admission all --policies kvgate
  kvgate bench sim --trace ../shared/traces/weka_agentic_coding/traces.tar.gz --trace-format weka
  kvgate bench sim --grid default --out out/grid --jobs 2
Prints a table, writes OUT/results.json (schema: docs/SIMULATOR.md) and PNG plots; --sweep adds
OUT/sweep.json and sweep_ttft_p99.png over several offered loads. Bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench.sim.profiles import ProfileError, list_profiles, load_profile
from bench.sim.registry import UnknownPolicy, resolve_policies, with_indexes
from bench.sim.report import (
    format_admission_table,
    format_sweep,
    format_table,
    plot_run,
    plot_sweep,
    sweep_document,
    write_json,
)
from bench.sim.runner import (
    Task,
    load_requests,
    overload_workload,
    prepare_workload,
    results_document,
    run_policies,
)
from bench.sim.scenarios import UnknownScenario, default_load, list_scenarios
from bench.sim.traces import TraceError, WekaOptions

if TYPE_CHECKING:
    from rich.progress import TaskID

DEFAULT_SWEEP = (0.4, 0.6, 0.8, 0.9, 1.0)


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvgate bench sim", description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--trace", help="a trace: Mooncake JSONL, or WEKA traces (a directory or tar; see --trace-format)"
    )
    source.add_argument("--scenario", help="generated workload; see --list-scenarios")
    source.add_argument(
        "--grid",
        help="robustness grid: 'default' or a grid TOML (bench/sim/grid.py); writes OUT/grid.json",
    )
    p.add_argument("--cache", help="grid run cache directory (default OUT/cache)")
    p.add_argument(
        "--trace-format",
        choices=("auto", "mooncake", "weka"),
        default="auto",
        help="mooncake (JSONL) or weka (a directory of kv-cache-tester JSON files, or their tar); "
        "auto: weka for a directory or tar, else mooncake",
    )
    weka = p.add_argument_group("WEKA traces (seeded by --seed)")
    weka.add_argument("--weka-conversations", type=int, default=80, help="conversations to replay (80)")
    weka.add_argument(
        "--weka-window", type=float, default=1800.0, help="spread conversation starts over this many s (1800)"
    )
    weka.add_argument(
        "--weka-duration", type=float, default=3600.0, help="keep each conversation's first N s (3600)"
    )
    weka.add_argument(
        "--weka-max-context",
        type=int,
        help="drop requests with input + output tokens above this (default: the profile's max context)",
    )
    p.add_argument("--list-scenarios", action="store_true", help="list scenario names and exit")
    p.add_argument("--workers", type=int, default=8, help="simulated GPU workers (default 8)")
    p.add_argument(
        "--load",
        type=float,
        help="offered load, fraction of cluster capacity (0.8; churn 1.6; overload: the steady phase, 0.6)",
    )
    p.add_argument("--policies", default="all", help="comma-separated policy names, or all (default)")
    p.add_argument(
        "--admission",
        help="admission gates, comma-separated or all (none,gie_shed,gie_flow,probabilistic,kvgate): "
        "one run per (policy, gate), with goodput and per-band metrics",
    )
    p.add_argument(
        "--index",
        help="index models for kvgate/article, comma-separated (exact,approx,oracle,feedback): one run each, "
        '"index" in results.json',
    )
    p.add_argument("--profile", default="h100-llama3.1-8b", help="engine profile (default h100-llama3.1-8b)")
    p.add_argument("--seed", type=int, default=1, help="seed for scenarios and randomised policies (1)")
    p.add_argument("--out", default="out/sim", help="output directory (default out/sim)")
    p.add_argument("--sweep", action="store_true", help="also run offered loads 0.4..1.0: TTFT p99 vs load")
    p.add_argument("--sweep-loads", help="comma-separated loads for --sweep (default 0.4,0.6,0.8,0.9,1.0)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel processes (cpu count)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--scrape-period", type=float, default=0.05, help="metrics scrape period in s (0.05)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        print(f"kvgate bench sim: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.list_scenarios:
        for name, help_text in list_scenarios():
            print(f"{name:<16} {help_text}")
        return 0
    if args.jobs <= 0:
        raise UsageError(f"--jobs must be > 0, got {args.jobs}")
    if args.grid is not None:
        return _grid_main(args)
    if args.trace is None and args.scenario is None:
        raise UsageError("give --trace PATH, --scenario NAME (see --list-scenarios) or --grid")
    if args.load is not None and args.load <= 0:
        raise UsageError(f"--load must be > 0, got {args.load}")
    if args.admission is not None and args.sweep:
        raise UsageError("--sweep does not combine with --admission")
    if args.workers <= 0:
        raise UsageError(f"--workers must be > 0, got {args.workers}")
    if args.limit is not None and args.limit < 2:
        raise UsageError(f"--limit must be >= 2, got {args.limit}")
    if args.scrape_period <= 0:
        raise UsageError(f"--scrape-period must be > 0, got {args.scrape_period}")
    if args.weka_conversations <= 0:
        raise UsageError(f"--weka-conversations must be > 0, got {args.weka_conversations}")
    if args.weka_window < 0 or args.weka_duration <= 0:
        raise UsageError("--weka-window must be >= 0 and --weka-duration > 0")
    if args.weka_max_context is not None and args.weka_max_context <= 0:
        raise UsageError(f"--weka-max-context must be > 0, got {args.weka_max_context}")
    loads = _sweep_loads(args.sweep_loads) if args.sweep else []
    try:
        profile = load_profile(args.profile)
        policies = resolve_policies(args.policies)
        if args.index is not None:
            policies = with_indexes(policies, args.index)
        admissions = None if args.admission is None else _admissions(args.admission)
        overload = args.scenario == "overload"
        weka = WekaOptions(
            conversations=args.weka_conversations,
            window_s=args.weka_window,
            max_context=args.weka_max_context or profile.max_context_tokens,
            duration_s=args.weka_duration,
            seed=args.seed,
        )
        name, requests = (
            ("", [])
            if overload
            else load_requests(args.trace, args.scenario, args.seed, args.limit, args.trace_format, weka)
        )
    except ProfileError as e:
        raise UsageError(f"{e} (profiles: {', '.join(list_profiles())})") from None
    except (UnknownPolicy, UnknownScenario, TraceError) as e:
        raise UsageError(str(e)) from None
    if not policies:
        raise UsageError("no policy is available")
    out = Path(args.out)
    try:
        if overload:
            workload = overload_workload(profile, args.workers, args.seed, args.limit, args.load)
            if loads:
                raise UsageError("--sweep does not apply to the overload scenario (it fixes its own load)")
        else:
            load = default_load(args.scenario) if args.load is None else args.load
            workload = prepare_workload(name, requests, profile, args.workers, load)
        sweep_workloads = [prepare_workload(name, requests, profile, args.workers, x) for x in loads]
    except ValueError as e:
        raise UsageError(str(e)) from None

    main_tasks: list[Task] = (
        [(p, workload) for p in policies]
        if admissions is None
        else [(p, workload, a) for p in policies for a in admissions]
    )
    tasks: list[Task] = main_tasks + [(p, w) for w in sweep_workloads for p in policies]
    runs = run_policies(tasks, args.profile, args.workers, args.seed, args.jobs, args.scrape_period)
    main_runs = runs[: len(main_tasks)]
    document = results_document(workload, main_runs, args.profile, args.workers, args.seed)
    write_json(out / "results.json", document)
    print(format_table(document))
    if admissions is not None:
        print()
        print(format_admission_table(document))
    if not args.no_plots:
        plot_run(out, document, main_runs)
    if loads:
        documents = []
        for i, w in enumerate(sweep_workloads):
            start = len(main_tasks) + len(policies) * i
            chunk = runs[start : start + len(policies)]
            doc = results_document(w, chunk, args.profile, args.workers, args.seed)
            write_json(out / f"load-{w.plan.load:g}" / "results.json", doc)
            documents.append(doc)
        sweep = sweep_document(name, args.workers, loads, documents)
        write_json(out / "sweep.json", sweep)
        print()
        print(format_sweep(sweep))
        if not args.no_plots:
            plot_sweep(out, sweep)
    print(f"\nwrote {out / 'results.json'}", file=sys.stderr)
    return 1 if any(r.error for r in runs) else 0


def _grid_main(args: argparse.Namespace) -> int:
    # imported here: plain runs do not need rich or the grid's modules
    from bench.sim.grid import GridError, default_grid, load_grid, run_grid
    from bench.sim.grid_report import format_by_workload, format_summary, grid_document, plot_heatmap

    try:
        policies = None if args.policies == "all" else resolve_policies(args.policies)
        spec = default_grid(policies) if args.grid == "default" else load_grid(args.grid, policies)
        load_profile(spec.profile)
    except (GridError, UnknownPolicy) as e:
        raise UsageError(str(e)) from None
    except ProfileError as e:
        raise UsageError(f"{e} (profiles: {', '.join(list_profiles())})") from None
    out = Path(args.out)
    cache_dir = Path(args.cache) if args.cache else out / "cache"
    try:
        with _progress_bar() as progress:
            grid = run_grid(spec, cache_dir, args.jobs, progress)
    except (TraceError, ValueError) as e:
        raise UsageError(str(e)) from None
    meta = {
        "grid": args.grid,
        "profile": spec.profile,
        "policies": list(spec.policies),
        "loads": list(spec.loads),
        "seeds": list(spec.seeds),
        "workers": list(spec.workers),
        "workloads": [w.name for w in spec.workloads],
        "computed_runs": grid.computed_runs,
        "cached_runs": grid.cached_runs,
        "wall_s": grid.wall_s,
        "jobs": args.jobs,
    }
    document = grid_document(grid.cells, spec.policies, meta)
    write_json(out / "grid.json", document)
    print(format_summary(document))
    if "kvgate" in spec.policies:
        print()
        print(format_by_workload(document, "kvgate"))
    if not args.no_plots:
        plot_heatmap(out / "grid_p99_ratio.png", document)
    print(
        f"\nwrote {out / 'grid.json'}: {len(grid.cells)} cells, {grid.computed_runs} runs computed, "
        f"{grid.cached_runs} cached, {grid.wall_s:.0f} s",
        file=sys.stderr,
    )
    for line in grid.failed:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if grid.failed else 0


class _progress_bar:
    """A rich progress bar over the (cell, policy) runs left to compute."""

    def __enter__(self) -> Callable[[int, int], None]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self._bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            transient=False,
        )
        self._task: TaskID | None = None
        self._bar.start()
        return self.update

    def update(self, done: int, total: int) -> None:
        if self._task is None:
            self._task = self._bar.add_task("grid runs", total=total)
        self._bar.update(self._task, completed=done)

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()


def _admissions(spec: str) -> list[str]:
    # imported here: a change in policy/admission.py must not break runs without a gate
    from bench.sim.admission import UnknownAdmission, resolve_admissions

    try:
        return resolve_admissions(spec)
    except UnknownAdmission as e:
        raise UsageError(str(e)) from None


def _sweep_loads(text: str | None) -> list[float]:
    if text is None:
        return list(DEFAULT_SWEEP)
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--sweep-loads must be comma-separated numbers, got {text!r}") from None
    if not loads or any(x <= 0 for x in loads):
        raise UsageError(f"--sweep-loads must be > 0, got {text!r}")
    return loads


if __name__ == "__main__":
    sys.exit(main())
