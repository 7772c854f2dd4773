"""`kvgate bench replay`: what-if replay of recorded traffic through the simulator under other policies.

    kvgate bench replay DECISIONS.jsonl --policies kvgate,round_robin --json out/replay.json

DECISIONS.jsonl is a decision log (`kvgate explain --export PATH`, or [decision_log] file). Every
routed record becomes one simulated request: its arrival time, its prompt length (the worker's own
count when the usage reported it), its prefix block hashes and per-block token counts, its output
length. The cluster is the recorded one: as many workers as the records name, each with the KV
capacity the agents registered (`--workers` / `--capacity-tokens` override). Refused requests never
reached a worker and are not replayed (counted in the output). Writes the `kvgate bench sim`
results.json schema (docs/SIMULATOR.md) with the recorded run's own figures as the first run
("recorded"), and prints the five core metrics side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.sim.profiles import load_profile
from bench.sim.registry import UnknownPolicy, resolve_policies
from bench.sim.report import write_json
from bench.sim.runner import PolicyRun, prepare_workload, results_document, run_object
from bench.sim.types import SimRequest
from bench.stats import percentile

CORE = ("hit_rate", "ttft_p50", "ttft_p99", "util_cv", "throughput_rps", "queue_p99")
DEFAULT_PROFILE = "h100-llama3.1-8b"  # the emulated workers' profile in the demo


class ReplayError(ValueError):
    """A decision log that cannot be replayed (printed as one line, exit 2)."""


def routed(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records of requests that reached a worker and finished, by arrival."""
    out = [
        r
        for r in records
        if r.get("worker") and r.get("prefix_hashes") is not None and r.get("status") == 200
    ]
    return sorted(out, key=lambda r: float(r["arrival_ms"]))


def to_requests(records: Sequence[Mapping[str, Any]]) -> list[SimRequest]:
    """Simulated requests from routed records (arrival relative to the first)."""
    if not records:
        raise ReplayError("no routed requests with prefix hashes in the decision log")
    t0 = float(records[0]["arrival_ms"])
    out = []
    for i, r in enumerate(records):
        est = [int(t) for t in r["block_tokens"]]
        actual = int(r.get("prompt_tokens") or r.get("prompt_tokens_est") or sum(est) or 1)
        blocks = _scaled(est, actual)
        out.append(
            SimRequest(
                id=i,
                arrival_s=(float(r["arrival_ms"]) - t0) / 1000,
                input_tokens=sum(blocks) if blocks else actual,
                output_tokens=max(1, int(r.get("output_tokens") or r.get("max_tokens") or 1)),
                block_ids=tuple(int(h) for h in r["prefix_hashes"]),
                block_tokens=tuple(blocks),
            )
        )
    return out


def _scaled(estimate: list[int], actual: int) -> list[int]:
    """Per-block token counts rescaled so they add up to the worker's own prompt length (the gateway
    estimates tokens from characters); at least one token per block."""
    total = sum(estimate)
    if not estimate or total <= 0:
        return []
    out, acc, done = [], 0.0, 0
    for t in estimate:
        acc += t * actual / total
        n = max(1, round(acc) - done)
        out.append(n)
        done += n
    return out


def recorded_workers(records: Sequence[Mapping[str, Any]]) -> list[str]:
    names = {str(r["worker"]) for r in records} | {w for r in records for w in (r.get("candidates") or {})}
    return sorted(names)


def recorded_metrics(records: Sequence[Mapping[str, Any]], workers: Sequence[str]) -> dict[str, object]:
    """The five core metrics of the recorded run, from the records' outcomes. Hit rate: the workers'
    reported cached prompt tokens over prompt tokens; util_cv: spread of the request-seconds each
    worker served (the live counterpart of the simulator's useful-work utilisation)."""
    ttft = sorted(float(r["ttft_ms"]) / 1000 for r in records if "ttft_ms" in r)
    queue = sorted(float(r.get("queued_ms") or 0) / 1000 for r in records)
    with_usage = [r for r in records if r.get("prompt_tokens") and r.get("cached_tokens") is not None]
    prompt = sum(int(r["prompt_tokens"]) for r in with_usage)
    busy: dict[str, float] = defaultdict(float)
    for r in records:
        busy[str(r["worker"])] += float(r.get("latency_ms") or 0) / 1000
    start = float(records[0]["arrival_ms"]) / 1000
    end = max(float(r["arrival_ms"]) / 1000 + float(r.get("latency_ms") or 0) / 1000 for r in records)
    util = [busy.get(w, 0.0) for w in workers]
    mean = statistics.fmean(util) if util else 0.0
    return {
        "hit_rate": sum(int(r["cached_tokens"]) for r in with_usage) / prompt if prompt else math.nan,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "util_cv": statistics.pstdev(util) / mean if mean > 0 else math.nan,
        "throughput_rps": len(records) / (end - start) if end > start else math.nan,
        "queue_p99": percentile(queue, 99),
        "requests": len(records),
        "policies": sorted({str(r.get("policy")) for r in records}),
    }


def read_log(path: Path) -> list[dict[str, Any]]:
    try:
        with path.open(encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    except OSError as e:
        raise ReplayError(f"{path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ReplayError(f"{path}: not a JSON-lines decision log ({e.msg})") from None


def replay(
    records: list[dict[str, Any]], policies: Sequence[str], *, profile_name: str, workers: int | None,
    capacity_tokens: int | None, seed: int, trace: str,
) -> dict[str, object]:  # fmt: skip
    """The results.json document: the recorded run first, then one simulated run per policy."""
    from bench.sim.cluster import simulate
    from bench.sim.metrics import compute_metrics
    from bench.sim.registry import make_router

    kept = routed(records)
    requests = to_requests(kept)
    names = recorded_workers(kept)
    n_workers = workers or len(names)
    capacity = capacity_tokens or max((int(r.get("capacity_tokens") or 0) for r in kept), default=0)
    profile = load_profile(profile_name)
    if capacity:
        profile = replace(profile, num_gpu_blocks=max(1, capacity // profile.block_size))
    runs = [PolicyRun(policy="recorded", metrics=recorded_metrics(kept, names))]
    for policy in policies:
        result = simulate(requests, make_router(policy, seed), profile, n_workers)
        runs.append(PolicyRun(policy=policy, metrics=compute_metrics(result, requests, profile)))
    workload = prepare_workload(trace, requests, profile, n_workers, 0.0, scale=False)
    document = results_document(workload, [], profile_name, n_workers, seed)
    document["runs"] = [run_object(r) for r in runs]
    document["replay"] = {
        "records": len(records),
        "replayed": len(kept),
        "not_replayed": len(records) - len(kept),
        "capacity_tokens": profile.capacity_tokens,
    }
    return document


def format_rows(document: Mapping[str, Any]) -> str:
    head = f"{'run':<14}" + "".join(f"{k:>16}" for k in CORE)
    rows = [head]
    for run in document["runs"]:
        m = run["metrics"]
        cells = []
        for k in CORE:
            v = m.get(k)
            cells.append(f"{'-':>16}" if v is None else f"{v:>16.1%}" if k == "hit_rate" else f"{v:>16.3f}")
        rows.append(f"{run['policy']:<14}" + "".join(cells))
    info = document["replay"]
    return (
        f"{document['trace']}: {info['replayed']} requests replayed ({info['not_replayed']} refused or "
        f"unfinished left out), {document['workers']} workers, {info['capacity_tokens']} KV tokens each, "
        f"profile {document['profile']} (times in s)\n" + "\n".join(rows)
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate bench replay", description=__doc__.split("\n")[0])
    p.add_argument("decisions", type=Path, help="decision log, JSON lines (kvgate explain --export)")
    p.add_argument("--policies", default="kvgate,round_robin", help="simulator policies (comma list, or all)")
    p.add_argument("--json", type=Path, help="write results.json (the kvgate bench sim schema) here")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="engine profile of the simulated workers")
    p.add_argument("--workers", type=int, help="simulated workers (default: as many as recorded)")
    p.add_argument("--capacity-tokens", type=int, help="KV tokens per worker (default: as registered)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        policies = resolve_policies(args.policies)
        document = replay(
            read_log(args.decisions), policies, profile_name=args.profile, workers=args.workers,
            capacity_tokens=args.capacity_tokens, seed=args.seed, trace=str(args.decisions),
        )  # fmt: skip
    except (ReplayError, UnknownPolicy, KeyError, ValueError) as e:
        print(f"kvgate bench replay: {e}", file=sys.stderr)
        return 2
    print(format_rows(document))
    if args.json:
        write_json(args.json, document)
    return 0
