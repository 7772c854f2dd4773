"""Runs a workload through every selected policy, one process per policy, and assembles results.json.

`prepare_workload` loads a trace or builds a scenario, computes the trace-only bounds and rescales the
arrivals to the offered load, once, so every policy replays the identical request sequence. `run_policy`
is the unit of work sent to a worker process (ProcessPoolExecutor); it returns plain data (metrics,
TTFT samples, load series), never engines or routers. With an admission gate (bench/sim/admission.py)
a task is a (policy, gate) pair; the `overload` scenario is built in absolute time for the cluster
(`overload_workload`, never rescaled) and carries its half-load twin, run with the same pair for the
`high_ttft_p99_at_half_load` reference.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace

from bench.sim.bounds import (
    infinite_cache_hit_rate,
    pooled_capacity_blocks,
    pooled_lru_hit_rate,
    reusable_working_set_tokens,
)
from bench.sim.cluster import SimResult, simulate
from bench.sim.load import LoadPlan, decode_token_cost_s, offered_load, scale_to_load, total_work_s
from bench.sim.metrics import admission_metrics, compute_metrics, load_series
from bench.sim.profiles import EngineProfile, load_profile
from bench.sim.registry import make_router, split_index
from bench.sim.scenarios import (
    HALF_LOAD_SCALE,
    OVERLOAD_STREAMS,
    build_scenario,
    overload_requests,
    overload_utilisation,
)
from bench.sim.traces import TRACE_BLOCK_TOKENS, WekaOptions, is_weka_source, load_trace, load_weka
from bench.sim.types import Router, SimRequest

CDF_POINTS = 1000  # TTFT samples kept per policy for the CDF plot


@dataclass(frozen=True, slots=True)
class Workload:
    name: str  # trace path, or "scenario:<name>"
    requests: list[SimRequest]  # sorted by arrival, already scaled to `plan.load`
    plan: LoadPlan
    infinite_hit_rate: float
    pooled_lru_hit_rate: float
    cache_pressure: float  # reusable working set / one worker's KV capacity
    reference: list[SimRequest] | None = None  # overload: the same scenario at half load


@dataclass(slots=True)
class PolicyRun:
    policy: str
    metrics: dict[str, object]
    admission: str | None = None
    ttft_samples: list[float] = field(default_factory=list)  # evenly spaced quantiles, for the CDF
    load_period_s: float = 1.0
    load_inflight: dict[str, list[int]] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None


def load_requests(
    trace: str | None,
    scenario: str | None,
    seed: int,
    limit: int | None,
    trace_format: str = "auto",
    weka: WekaOptions | None = None,
) -> tuple[str, list[SimRequest]]:
    """A trace (Mooncake JSONL, or WEKA: `trace_format` auto picks WEKA for a directory or tar) or a
    scenario; the WEKA choices are seeded by `seed` unless `weka` says otherwise."""
    if trace is not None:
        if trace_format == "weka" or (trace_format == "auto" and is_weka_source(trace)):
            options = weka or WekaOptions(seed=seed)
            return trace, load_weka(trace, options)[:limit]
        return trace, load_trace(trace, limit)
    if scenario is None:
        raise ValueError("give --trace PATH or --scenario NAME")
    return f"scenario:{scenario}", build_scenario(scenario, seed, limit)


OVERLOAD_STEADY_LOAD = sum(s.steady_load for s in OVERLOAD_STREAMS)  # 0.6


def overload_workload(
    profile: EngineProfile, workers: int, seed: int, limit: int | None, steady_load: float | None
) -> Workload:
    """The overload scenario for this cluster; `steady_load` rescales every phase (default 0.6 steady,
    2.0 in the burst). The half-load reference keeps the steady mix at 0.5 throughout."""
    scale = 1.0 if steady_load is None else steady_load / OVERLOAD_STEADY_LOAD
    requests = overload_requests(seed, profile, workers, load_scale=scale)[:limit]
    reference = overload_requests(seed, profile, workers, load_scale=HALF_LOAD_SCALE, burst=False)[:limit]
    workload = prepare_workload("scenario:overload", requests, profile, workers, 0.0, scale=False)
    # its load is against measured capacity (bench/sim/capacity.py), not W: 1.0 over the whole run
    load = overload_utilisation(requests, profile, workers)
    return _with_reference(replace(workload, plan=replace(workload.plan, load=load)), reference)


def _with_reference(workload: Workload, reference: list[SimRequest]) -> Workload:
    return Workload(
        workload.name,
        workload.requests,
        workload.plan,
        workload.infinite_hit_rate,
        workload.pooled_lru_hit_rate,
        workload.cache_pressure,
        reference,
    )


def prepare_workload(
    name: str,
    requests: Sequence[SimRequest],
    profile: EngineProfile,
    workers: int,
    load: float,
    scale: bool = True,
) -> Workload:
    """Rescale to `load` (or, `scale=False`, keep the arrival times and report their offered load)."""
    if scale:
        scaled, plan = scale_to_load(profile, requests, workers, load)
    else:
        scaled = list(requests)
        span = scaled[-1].arrival_s - scaled[0].arrival_s
        actual = offered_load(profile, scaled, workers)
        plan = LoadPlan(
            actual, total_work_s(profile, scaled), span, 1.0, decode_token_cost_s(profile, scaled)
        )
    capacity_blocks = pooled_capacity_blocks(workers, profile.capacity_tokens, TRACE_BLOCK_TOKENS)
    return Workload(
        name=name,
        requests=scaled,
        plan=plan,
        infinite_hit_rate=infinite_cache_hit_rate(scaled),
        pooled_lru_hit_rate=pooled_lru_hit_rate(scaled, capacity_blocks),
        cache_pressure=reusable_working_set_tokens(scaled) / profile.capacity_tokens,
    )


def run_policy(
    policy: str,
    requests: Sequence[SimRequest],
    profile_name: str,
    workers: int,
    seed: int,
    scrape_period_s: float = 0.05,
    progress: Callable[[int, int], None] | None = None,
    admission: str | None = None,
    reference: Sequence[SimRequest] | None = None,
) -> PolicyRun:
    """Simulate one policy (in whatever process calls it) and reduce the run to plain data; with an
    `admission` gate, add goodput and per-band metrics, and the high-band TTFT p99 of `reference`."""
    started = time.perf_counter()
    profile = load_profile(profile_name)
    routers: list[Router] = []

    def sim(reqs: Sequence[SimRequest], report: Callable[[int, int], None] | None) -> SimResult:
        router = make_router(policy, seed)
        routers.append(router)
        if admission is None:
            return simulate(reqs, router, profile, workers, scrape_period_s=scrape_period_s, progress=report)
        # imported here: a change in policy/admission.py must not break runs without a gate
        from bench.sim.admission import GatedRouter, make_gate

        gate = make_gate(admission, profile, workers, seed)
        gated = GatedRouter(router, gate)
        out = simulate(
            reqs, gated, profile, workers, scrape_period_s=scrape_period_s, gate=gate, progress=report
        )
        for rid in gate.dropped:  # left the gate's queue with its wait budget spent: answered 429
            out.records[rid].rejected = True
        return out

    result = sim(requests, progress)
    metrics = compute_metrics(result, requests, profile)
    sessions = getattr(routers[0], "session_outcomes", None)  # kvgate_session: policy.session.outcome counts
    if sessions:
        metrics["session_outcomes"] = dict(sorted(sessions.items()))
    if admission is not None:
        metrics |= admission_metrics(result, requests)
        metrics["rejected"] = sum(r.rejected for r in result.records)
        half = None
        if reference:
            by_band = admission_metrics(sim(reference, None), reference)["by_priority"]
            half = by_band["high"]["ttft_p99"]  # type: ignore[index]
        metrics["high_ttft_p99_at_half_load"] = half
    series = load_series(result.records, result.worker_ids)
    ttft = sorted(r.first_token_s - r.arrival_s for r in result.records if r.first_token_s is not None)
    samples = (
        [ttft[min(len(ttft) - 1, (i * len(ttft)) // CDF_POINTS)] for i in range(CDF_POINTS)] if ttft else []
    )
    return PolicyRun(
        policy=policy,
        metrics=metrics,
        admission=admission,
        ttft_samples=samples,
        load_period_s=series.period_s,
        load_inflight=series.inflight,
        wall_s=time.perf_counter() - started,
    )


def safe_run(*args: object, **kwargs: object) -> PolicyRun:
    try:
        return run_policy(*args, **kwargs)  # type: ignore[arg-type]
    except Exception as e:  # a broken peer must not sink the other policies' results
        admission = kwargs.get("admission")
        return PolicyRun(
            policy=str(args[0]),
            metrics={},
            admission=None if admission is None else str(admission),
            error=f"{type(e).__name__}: {e}",
        )


Task = tuple[str, "Workload"] | tuple[str, "Workload", str | None]  # (policy, workload[, admission])


def _task_kwargs(task: Task) -> dict[str, object]:
    admission = task[2] if len(task) > 2 else None
    if admission is None:
        return {}
    return {"admission": admission, "reference": task[1].reference}


def _label(task: Task) -> str:
    admission = task[2] if len(task) > 2 else None
    return task[0] if admission is None else f"{task[0]}+{admission}"


def run_policies(
    tasks: Sequence[Task],
    profile_name: str,
    workers: int,
    seed: int,
    jobs: int,
    scrape_period_s: float = 0.05,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> list[PolicyRun]:
    """Run (policy, workload[, admission]) tasks, `jobs` processes at a time; results in task order."""
    total = len(tasks)
    results: list[PolicyRun | None] = [None] * total
    log(f"simulating {total} run(s) on {workers} workers, {min(jobs, total)} process(es)")
    if jobs <= 1 or total == 1:
        for i, task in enumerate(tasks):
            policy, workload = task[0], task[1]
            results[i] = safe_run(
                policy,
                workload.requests,
                profile_name,
                workers,
                seed,
                scrape_period_s,
                _progress(_label(task), log),
                **_task_kwargs(task),
            )
            _report_done(i + 1, total, results[i], log)  # type: ignore[arg-type]
        return [r for r in results if r is not None]
    with ProcessPoolExecutor(max_workers=min(jobs, total)) as pool:
        futures: dict[Future[PolicyRun], int] = {
            pool.submit(
                safe_run,
                task[0],
                task[1].requests,
                profile_name,
                workers,
                seed,
                scrape_period_s,
                None,
                **_task_kwargs(task),
            ): i
            for i, task in enumerate(tasks)
        }
        for done, future in enumerate(as_completed(futures), start=1):
            run = future.result()
            results[futures[future]] = run
            _report_done(done, total, run, log)
    return [r for r in results if r is not None]


def _progress(policy: str, log: Callable[[str], None], every_s: float = 5.0) -> Callable[[int, int], None]:
    """Log a run's progress at most every `every_s` seconds of wall time (quiet for short runs)."""
    last = [time.monotonic()]

    def show(arrived: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[0] = now
            log(f"  {policy}: {arrived}/{total} arrivals ({arrived / total:.0%})")

    return show


def _report_done(done: int, total: int, run: PolicyRun, log: Callable[[str], None]) -> None:
    label = run.policy if run.admission is None else f"{run.policy}+{run.admission}"
    if run.error:
        log(f"[{done}/{total}] {label} FAILED: {run.error}")
        return
    p99 = run.metrics.get("ttft_p99", math.nan)
    log(f"[{done}/{total}] {label} done in {run.wall_s:.1f} s (ttft p99 {p99:.3f} s)")


def results_document(
    workload: Workload, runs: Sequence[PolicyRun], profile_name: str, workers: int, seed: int
) -> dict[str, object]:
    """The results.json object (schema in docs/SIMULATOR.md; the issue-2 keys never change)."""
    return {
        "trace": workload.name,
        "workers": workers,
        "load": workload.plan.load,
        "bounds": {
            "infinite_hit_rate": workload.infinite_hit_rate,
            "pooled_lru_hit_rate": workload.pooled_lru_hit_rate,
        },
        "runs": [run_object(r) for r in runs],
        "profile": profile_name,
        "seed": seed,
        "requests": len(workload.requests),
        "cache_pressure": workload.cache_pressure,
        "load_plan": asdict(workload.plan),
    }


def run_object(run: PolicyRun) -> dict[str, object]:
    """One entry of results.json `runs` (and of grid.json cells' `runs`)."""
    return (
        {"policy": split_index(run.policy)[0], "metrics": _finite(run.metrics), "wall_s": run.wall_s}
        | ({"index": split_index(run.policy)[1]} if "@" in run.policy else {})
        | ({"admission": run.admission} if run.admission is not None else {})
        | ({"error": run.error} if run.error else {})
    )


def _finite(metrics: dict[str, object]) -> dict[str, object]:
    """NaN (no samples) becomes null so the file is strict JSON (nested objects too)."""
    return {k: _finite_value(v) for k, v in metrics.items()}


def _finite_value(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_value(v) for k, v in value.items()}
    return value
