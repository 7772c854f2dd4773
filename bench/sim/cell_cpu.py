"""CPU seconds of one default-grid cell's runs (every policy, in this process, as a grid worker runs
them), and optionally its run objects, to time the simulator and check a speed-up changes no result:

    python -m bench.sim.cell_cpu WORKLOAD LOAD SEED WORKERS [--json OUT.json]
    python -m bench.sim.same_results BEFORE.json AFTER.json

Prints `WORKLOAD LOAD SEED WORKERS: S s CPU` (the simulations alone: no process start, no workload
materialisation).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.sim.grid import CellTask, _run_cell, default_grid, materialise
from bench.sim.profiles import load_profile
from bench.sim.runner import prepare_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.cell_cpu")
    parser.add_argument("workload")
    parser.add_argument("load", type=float)
    parser.add_argument("seed", type=int)
    parser.add_argument("workers", type=int)
    parser.add_argument("--json", type=Path, help="write the cell's run objects ({'runs': [...]})")
    args = parser.parse_args(argv)
    spec = default_grid()
    workload = next((w for w in spec.workloads if w.name == args.workload), None)
    if workload is None:
        parser.error(f"no default-grid workload {args.workload!r}")
    requests = materialise(workload, args.seed, spec.profile)
    prepared = prepare_workload(workload.name, requests, load_profile(spec.profile), args.workers, args.load)
    task = CellTask(
        0, prepared.requests, list(spec.policies), spec.profile, args.workers, args.seed, spec.scrape_period_s
    )
    started = time.process_time()
    _, runs = _run_cell(task)
    cpu = time.process_time() - started
    print(f"{args.workload} {args.load:g} {args.seed} {args.workers}: {cpu:.1f} s CPU")
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
