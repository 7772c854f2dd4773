"""The robustness grid: every policy over workloads × offered loads × seeds × worker counts.

    kvgate bench sim --grid default --out out/grid --jobs 2
    kvgate bench sim --grid my_grid.toml --out out/grid

A grid file (TOML; relative paths are relative to the file):

    profile = "h100-llama3.1-8b"          # optional
    policies = "all"                      # or a list of names
    loads = [0.5, 0.9]
    seeds = [1, 2]
    workers = [8]
    [[workload]]                          # one table per workload
    name = "conversation"
    trace = "conversation_trace.jsonl"    # or scenario = "multi_tenant"
    format = "mooncake"                   # optional: auto (default), mooncake, weka
    requests = 800                        # requests per cell (see `materialise`)
    conversations = 24                    # weka only, with window_s, duration_s, max_context

A cell is (workload, load, seed, workers); each policy's run in it is cached in CACHE/<key>.json, the key
a hash of everything the run depends on (`run_key`): the workload's definition and source file, the cell,
the policy, the profile file, the scrape period, and the source of the code that decides the result
(the simulator's core, the policy's own module, policy/ for kvgate's policies). A re-run recomputes only
the runs whose key changed. DIR/grid.json holds the cells with their results.json run objects and the
per-policy summary (bench/sim/grid_report.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

from bench.sim.profiles import PROFILE_DIR, load_profile
from bench.sim.registry import POLICIES, resolve_policies, run_name, split_index
from bench.sim.runner import prepare_workload, run_object, safe_run
from bench.sim.scenarios import SCENARIOS, build_scenario
from bench.sim.traces import WekaOptions, is_weka_source, load_trace, load_weka
from bench.sim.types import SimRequest

GRID_FORMAT = 1  # bump when the cached run objects change shape
REPO = Path(__file__).resolve().parents[2]
SIM_DIR = Path(__file__).resolve().parent
# presentation only: editing these never changes a run's result
_NOT_RESULT_CODE = {
    "cli.py",
    "report.py",
    "grid_report.py",
    "engine_microbench.py",
    "goals.py",
    "cell_cpu.py",
    "same_results.py",
}


class GridError(ValueError):
    """A grid file or default grid that cannot run; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """One workload of the grid; `seed` varies what `materialise` picks (slice, sample, offsets)."""

    name: str
    trace: str | None = None  # path (absolute once parsed)
    scenario: str | None = None
    format: str = "auto"
    requests: int | None = None  # per cell; None = the whole trace / scenario default
    conversations: int = 80  # weka
    window_s: float = 1800.0  # weka
    duration_s: float = 3600.0  # weka
    max_context: int | None = None  # weka; None = the profile's max context


@dataclass(frozen=True, slots=True)
class GridSpec:
    workloads: tuple[WorkloadSpec, ...]
    loads: tuple[float, ...]
    seeds: tuple[int, ...]
    workers: tuple[int, ...]
    policies: tuple[str, ...]
    profile: str = "h100-llama3.1-8b"
    scrape_period_s: float = 0.05


@dataclass(frozen=True, slots=True)
class Cell:
    workload: WorkloadSpec
    load: float
    seed: int
    workers: int

    def label(self) -> str:
        return f"{self.workload.name} L{self.load:g} s{self.seed} w{self.workers}"


def traces_dir() -> Path:
    """Where the shipped traces are: $KVGATE_TRACES, else the nearest shared/traces beside the
    checkout or one of its parents (../shared/traces for /work/main, also from a worktree below)."""
    env = os.environ.get("KVGATE_TRACES")
    if env:
        return Path(env)
    for parent in REPO.parents:
        if (parent / "shared" / "traces").is_dir():
            return parent / "shared" / "traces"
    return REPO.parent / "shared" / "traces"


# The default grid: per-cell sizes chosen so that all of it runs in <= 20 min on 2 cores (measured in
# docs/BENCHMARKS.md); each seed replays a different slice / sample of every trace.
DEFAULT_REQUESTS = 600
DEFAULT_LOADS = (0.5, 0.7, 0.8, 0.9, 1.0, 1.2)
DEFAULT_SEEDS = (1, 2, 3)
DEFAULT_WORKERS = (8, 16)


def default_grid(policies: Sequence[str] | None = None) -> GridSpec:
    root = traces_dir()
    n = DEFAULT_REQUESTS
    traces = [
        WorkloadSpec(
            "mooncake_conversation", str(root / "mooncake_fast25/conversation_trace.jsonl"), requests=n
        ),
        WorkloadSpec("mooncake_synthetic", str(root / "mooncake_fast25/synthetic_trace.jsonl"), requests=n),
        WorkloadSpec(
            "mooncake_arxiv", str(root / "mooncake_arxiv_first1000/mooncake_trace_1000.jsonl"), requests=n
        ),
        WorkloadSpec(
            "weka_mix",
            str(root / "weka_agentic_coding/traces.tar.gz"),
            format="weka",
            requests=n,
            conversations=24,
            window_s=600.0,
            duration_s=1800.0,
        ),
    ]
    scenarios = [WorkloadSpec(name, scenario=name, requests=n) for name in SCENARIOS]
    return GridSpec(
        workloads=tuple(traces + scenarios),
        loads=DEFAULT_LOADS,
        seeds=DEFAULT_SEEDS,
        workers=DEFAULT_WORKERS,
        policies=tuple(policies or resolve_policies("all")),
    )


def load_grid(path: str | Path, policies: Sequence[str] | None = None) -> GridSpec:
    """A grid TOML file (see module docstring); `policies` overrides the file's."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise GridError(f"{path}: cannot read grid file ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise GridError(f"{path}: not valid TOML: {e}") from None
    known = {"profile", "policies", "loads", "seeds", "workers", "workload", "scrape_period_s"}
    for key in raw:
        if key not in known:
            raise GridError(f"{path}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    tables = raw.get("workload")
    if not isinstance(tables, list) or not tables:
        raise GridError(f"{path}: needs at least one [[workload]] table")
    workloads = tuple(_workload(t, path, i) for i, t in enumerate(tables))
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise GridError(f"{path}: workload names must be unique, got {names}")
    spec_policies = raw.get("policies", "all")
    if policies is None:
        if isinstance(spec_policies, str):
            policies = resolve_policies(spec_policies)
        elif isinstance(spec_policies, list) and all(isinstance(p, str) for p in spec_policies):
            policies = resolve_policies(",".join(spec_policies))
        else:
            raise GridError(f"{path}: policies must be 'all' or a list of names")
    return GridSpec(
        workloads=workloads,
        loads=tuple(_numbers(raw, "loads", float, path, DEFAULT_LOADS)),
        seeds=tuple(_numbers(raw, "seeds", int, path, DEFAULT_SEEDS)),
        workers=tuple(_numbers(raw, "workers", int, path, DEFAULT_WORKERS)),
        policies=tuple(policies),
        profile=str(raw.get("profile", "h100-llama3.1-8b")),
        scrape_period_s=float(raw.get("scrape_period_s", 0.05)),
    )


def _numbers(raw: dict[str, Any], key: str, kind: type, path: Path, default: Sequence[Any]) -> list[Any]:
    values = raw.get(key, list(default))
    ok = (
        isinstance(values, list)
        and values
        and all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values)
    )
    if not ok or (kind is int and not all(isinstance(v, int) for v in values)):
        raise GridError(
            f"{path}: {key} must be a non-empty list of positive {kind.__name__}s, got {values!r}"
        )
    return [kind(v) for v in values]


def _workload(table: object, path: Path, index: int) -> WorkloadSpec:
    where = f"{path}: workload {index + 1}"
    if not isinstance(table, dict):
        raise GridError(f"{where}: must be a table")
    allowed = {f for f in WorkloadSpec.__dataclass_fields__}
    for key in table:
        if key not in allowed:
            raise GridError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(allowed))})")
    if ("trace" in table) == ("scenario" in table):
        raise GridError(f"{where}: give exactly one of trace or scenario")
    if "scenario" in table and table["scenario"] not in SCENARIOS:
        raise GridError(f"{where}: unknown scenario {table['scenario']!r}; known: {', '.join(SCENARIOS)}")
    values = dict(table)
    values.setdefault("name", values.get("scenario") or Path(str(values["trace"])).stem)
    if "trace" in values:
        trace = Path(str(values["trace"]))
        values["trace"] = str(trace if trace.is_absolute() else (path.parent / trace).resolve())
    if values.get("format", "auto") not in ("auto", "mooncake", "weka"):
        raise GridError(f"{where}: format must be auto, mooncake or weka")
    try:
        spec = WorkloadSpec(**values)
    except TypeError as e:
        raise GridError(f"{where}: {e}") from None
    if spec.requests is not None and (not isinstance(spec.requests, int) or spec.requests < 2):
        raise GridError(f"{where}: requests must be an integer >= 2")
    return spec


def cells_of(spec: GridSpec) -> list[Cell]:
    return [
        Cell(w, load, seed, workers)
        for w in spec.workloads
        for workers in spec.workers
        for seed in spec.seeds
        for load in spec.loads
    ]


# ---- workloads --------------------------------------------------------------------------------------


def materialise(w: WorkloadSpec, seed: int, profile_name: str) -> list[SimRequest]:
    """The requests of a workload for one seed, arrival times as recorded (the cell rescales them).

    Mooncake traces: `requests` consecutive lines from a seeded start (the whole file if shorter).
    WEKA: the seeded conversation sample, offsets and caps of `load_weka`, then its first `requests`
    arrivals. Scenarios: generated with the seed and `requests` requests, except `overload`, whose
    timeline (steady, a 60 s burst, back) is built whole and thinned to every k-th request.
    """
    if w.scenario is not None:
        if w.scenario == "overload" and w.requests is not None:
            full = build_scenario("overload", seed)
            step = max(1, len(full) // w.requests)
            kept = full[::step][: w.requests]
            return [replace(r, id=i) for i, r in enumerate(kept)]
        return build_scenario(w.scenario, seed, w.requests)
    assert w.trace is not None
    if w.format == "weka" or (w.format == "auto" and is_weka_source(w.trace)):
        profile = load_profile(profile_name)
        options = WekaOptions(
            conversations=w.conversations,
            window_s=w.window_s,
            max_context=w.max_context or profile.max_context_tokens,
            duration_s=w.duration_s,
            seed=seed,
        )
        return load_weka(w.trace, options)[: w.requests]
    full = load_trace(w.trace)
    if w.requests is None or len(full) <= w.requests:
        return full
    start = random.Random(seed).randrange(len(full) - w.requests + 1)
    return [replace(r, id=i) for i, r in enumerate(full[start : start + w.requests])]


# ---- cache keys -------------------------------------------------------------------------------------


@cache
def _file_digest(path: str) -> str:
    p = Path(path)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(p.glob("*.json")):
            h.update(f.name.encode())
            h.update(_file_digest(str(f)).encode())
        return h.hexdigest()
    h = hashlib.sha256()
    try:
        with p.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return "missing"
    return h.hexdigest()


def _tree_digest(files: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f.relative_to(REPO)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _core_files() -> list[Path]:
    return [f for f in SIM_DIR.glob("*.py") if f.name not in _NOT_RESULT_CODE] + [REPO / "bench" / "stats.py"]


@cache
def _core_digest() -> str:
    return _tree_digest(_core_files())


@cache
def code_digest(policy: str) -> str:
    """Hash of the source that decides `policy`'s results: the simulator core (bench/sim, minus its
    presentation modules), bench/stats.py, and the policy's own code (its registry module; policy/
    for kvgate's policies; bench/peers/ for peers, which share helpers)."""
    core = _core_files()
    module = POLICIES[split_index(policy)[0]].split(":")[0]  # "kvgate@exact": kvgate's code
    own: list[Path] = []
    if module.startswith("bench.peers."):
        own = list((REPO / "bench" / "peers").glob("*.py"))
    elif module == "bench.sim.policy_router":
        own = list((REPO / "policy").rglob("*.py"))
    return _tree_digest(core + own)


def run_key(cell: Cell, policy: str, spec: GridSpec) -> str:
    """The cache key of one (cell, policy) run."""
    workload = asdict(cell.workload)
    source = cell.workload.trace
    profile_file = _profile_file(spec.profile)
    inputs = {
        "format": GRID_FORMAT,
        "workload": workload,
        "source": _file_digest(source) if source else None,
        "load": cell.load,
        "seed": cell.seed,
        "workers": cell.workers,
        "policy": policy,
        "profile": _file_digest(str(profile_file)) if profile_file.is_file() else spec.profile,
        "scrape_period_s": spec.scrape_period_s,
        "code": code_digest(policy),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def _profile_file(profile: str) -> Path:
    return Path(profile) if profile.endswith(".toml") else PROFILE_DIR / f"{profile}.toml"


def bounds_key(cell: Cell, spec: GridSpec) -> str:
    """The cache key of a cell's workload bounds (they depend on the requests and worker count only)."""
    inputs = {
        "format": GRID_FORMAT,
        "workload": asdict(cell.workload),
        "source": _file_digest(cell.workload.trace) if cell.workload.trace else None,
        "seed": cell.seed,
        "workers": cell.workers,
        "profile": spec.profile,
        "code": _core_digest(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


# ---- running ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class CellTask:
    """What a worker process needs to run the missing policies of one cell."""

    index: int
    requests: list[SimRequest]  # scaled to the cell's load
    policies: list[str]
    profile: str
    workers: int
    seed: int
    scrape_period_s: float


# Policies that route exactly as another one on requests without a session id: kvgate_session is
# kvgate with clients that send their session ids (bench/sim/policy_router.py reads a session only
# when a request carries one), so on a workload without sessions its run is kvgate's, bit for bit.
SESSION_TWINS = {"kvgate_session": "kvgate"}


def _same_run_as(policy: str, requests: Sequence[SimRequest]) -> str:
    """The policy whose run `policy`'s run equals on `requests` (itself unless a session twin applies)."""
    base, index = split_index(policy)
    twin = SESSION_TWINS.get(base)
    if twin is None or any(r.session is not None for r in requests):
        return policy
    return twin if index is None else f"{twin}@{index}"


def _run_cell(task: CellTask) -> tuple[int, list[dict[str, object]]]:
    """The cell's runs, in task order; a session twin's run is computed once and filed under both names
    (its `wall_s` is 0: nothing ran for it)."""
    computed: dict[str, dict[str, object]] = {}
    runs = []
    for p in task.policies:
        same = _same_run_as(p, task.requests)
        if same in computed:
            runs.append(computed[same] | {"policy": split_index(p)[0], "wall_s": 0.0})
            continue
        run = run_object(
            safe_run(p, task.requests, task.profile, task.workers, task.seed, task.scrape_period_s, None)
        )
        computed[same] = run
        runs.append(run)
    return task.index, runs


@dataclass(slots=True)
class GridRun:
    """The grid's cells with their runs and bounds, and what the run cost."""

    cells: list[dict[str, object]]
    computed_runs: int = 0
    cached_runs: int = 0
    wall_s: float = 0.0
    failed: list[str] = field(default_factory=list)


Progress = Callable[[int, int], None]  # (runs done, runs to compute)


def run_grid(
    spec: GridSpec,
    cache_dir: Path,
    jobs: int,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> GridRun:
    """Run every (cell, policy) whose result is not cached; returns all cells, cached ones included."""
    started = time.perf_counter()
    profile = load_profile(spec.profile)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cells = cells_of(spec)
    runs: list[dict[str, dict[str, object]]] = [{} for _ in cells]
    keys: list[dict[str, str]] = []
    missing: list[list[str]] = []
    for i, cell in enumerate(cells):
        keys.append({p: run_key(cell, p, spec) for p in spec.policies})
        todo = []
        for p in spec.policies:
            cached = _read_cache(cache_dir / f"{keys[i][p]}.json")
            if cached is None:
                todo.append(p)
            else:
                runs[i][p] = cached
        missing.append(todo)
    to_compute = sum(len(m) for m in missing)
    result = GridRun(cells=[], cached_runs=len(cells) * len(spec.policies) - to_compute)
    log(
        f"grid: {len(cells)} cells x {len(spec.policies)} policies; {result.cached_runs} runs cached, "
        f"{to_compute} to compute on {jobs} process(es)"
    )
    bounds: dict[tuple[str, int, int], dict[str, object]] = {}
    base: dict[tuple[str, int], list[SimRequest]] = {}

    def tasks() -> Iterable[CellTask]:
        for i, cell in enumerate(cells):
            if not missing[i]:
                continue
            requests = _base(base, cell, spec)
            workload = prepare_workload(cell.workload.name, requests, profile, cell.workers, cell.load)
            bounds[(cell.workload.name, cell.seed, cell.workers)] = _bounds(workload)
            yield CellTask(
                i, workload.requests, missing[i], spec.profile, cell.workers, cell.seed, spec.scrape_period_s
            )

    done = 0

    def store(index: int, computed: list[dict[str, object]]) -> None:
        nonlocal done
        for run in computed:
            policy = run_name(run)  # "kvgate@exact" is not "kvgate": its own slot and cache entry
            runs[index][policy] = run
            if run.get("error"):
                result.failed.append(f"{cells[index].label()} {policy}: {run['error']}")
            else:
                _write_cache(cache_dir / f"{keys[index][policy]}.json", run)
        done += len(computed)
        if progress is not None:
            progress(done, to_compute)

    if to_compute and jobs <= 1:
        for task in tasks():
            store(*_run_cell(task))
    elif to_compute:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures: list[Future[tuple[int, list[dict[str, object]]]]] = []
            for task in tasks():
                futures.append(pool.submit(_run_cell, task))
            for future in as_completed(futures):
                store(*future.result())
    result.computed_runs = done
    for i, cell in enumerate(cells):
        key = (cell.workload.name, cell.seed, cell.workers)
        bounds_file = cache_dir / f"bounds-{bounds_key(cell, spec)}.json"
        if key in bounds:
            _write_cache(bounds_file, bounds[key])
        else:  # every run of the cell was cached: so, usually, are its bounds
            found = _read_cache(bounds_file)
            if found is None:
                requests = _base(base, cell, spec)
                found = _bounds(
                    prepare_workload(cell.workload.name, requests, profile, cell.workers, cell.load)
                )
                _write_cache(bounds_file, found)
            bounds[key] = found
        result.cells.append(
            {
                "workload": cell.workload.name,
                "load": cell.load,
                "seed": cell.seed,
                "workers": cell.workers,
                "runs": [runs[i][p] for p in spec.policies if p in runs[i]],
                "bounds": bounds[key],
            }
        )
    result.wall_s = time.perf_counter() - started
    return result


def _base(memo: dict[tuple[str, int], list[SimRequest]], cell: Cell, spec: GridSpec) -> list[SimRequest]:
    key = (cell.workload.name, cell.seed)
    if key not in memo:
        memo[key] = materialise(cell.workload, cell.seed, spec.profile)
    return memo[key]


def _bounds(workload: Any) -> dict[str, object]:
    return {
        "infinite_hit_rate": workload.infinite_hit_rate,
        "pooled_lru_hit_rate": workload.pooled_lru_hit_rate,
        "requests": len(workload.requests),
        "cache_pressure": workload.cache_pressure,
    }


def _read_cache(path: Path) -> dict[str, object] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _write_cache(path: Path, run: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(run, allow_nan=False))
    tmp.replace(path)  # atomic: a killed run never leaves half a file behind
