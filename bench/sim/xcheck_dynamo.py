"""Cross-check the simulator against NVIDIA Dynamo's own offline trace replay.

    python -m bench.sim.xcheck_dynamo TRACE --json PATH [--profile NAME] [--workers N] [--seed N]

Dynamo's replay (`dynamo.replay.run_trace_replay`, ai-dynamo 1.6.1) runs Dynamo's real KV router
(its Rust selector) or round robin in front of its mocker engine, in virtual time. This runs that
replay with `router_mode="kv_router"` and `"round_robin"`, and the kvgate simulator with its
`dynamo` (bench/peers/dynamo.py, our re-implementation) and `round_robin` policies, on the same
Mooncake trace at its own timestamps, with the mocker's engine set to the simulator's profile as
far as its options go: KV block size, KV blocks per worker, max_num_seqs, max_num_batched_tokens.
Its step times stay the mocker's own model (docs/SIMULATOR.md, "Cross-check against Dynamo").

PATH gets `{"dynamo_replay": {"kv_router": M, "round_robin": M}, "kvgate_sim": {"dynamo": M,
"round_robin": M}}` with M = `{"hit_rate", "ttft_p50", "ttft_p99"}` (fractions, seconds); stdout gets
the same side by side with each simulator's kv ÷ round-robin ratios and the issue-9 goal checks.

Dynamo is an optional extra, not a test dependency: `pip install -e '.[xcheck]'` then
`pip install --no-deps ai-dynamo==1.6.1` (its `aisimulate` dependency downloads from outside at
install time; the offline replay needs none of ai-dynamo's other dependencies).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.sim.profiles import EngineProfile, load_profile
from bench.sim.runner import run_policy
from bench.sim.traces import TRACE_BLOCK_TOKENS, TraceError, load_trace

DYNAMO_MODES = ("kv_router", "round_robin")
KVGATE_POLICIES = ("dynamo", "round_robin")  # the same two routers, in the same order
METRIC_KEYS = ("hit_rate", "ttft_p50", "ttft_p99")
# the issue-9 goal: hit rates within 3 points, round-robin ÷ KV-router TTFT p50 within ±30 %
HIT_GOAL_POINTS = 3.0
# the kvgate side's engine: the mocker's default timing model written as one of our profiles, so that both
# simulators run at the same engine speed (bench/sim/profiles/dynamo-mocker-1.6.1.toml)
MATCHED_PROFILE = "dynamo-mocker-1.6.1"
RATIO_GOAL = 0.30

Metrics = dict[str, float]


class DynamoMissing(RuntimeError):
    """ai-dynamo is not installed here; the message says how to install it."""


INSTALL_HINT = (
    "NVIDIA Dynamo's replay is not installed: pip install -e '.[xcheck]' && "
    "pip install --no-deps ai-dynamo==1.6.1 (docs/SIMULATOR.md, 'Cross-check against Dynamo')"
)


def mocker_engine_args(profile: EngineProfile) -> dict[str, Any]:
    """The mocker's engine options closest to `profile` (its `extra_engine_args`)."""
    return {
        "engine": {
            "block_size": profile.block_size,
            "num_gpu_blocks": profile.num_gpu_blocks,
            "max_num_seqs": profile.max_num_seqs,
            "max_num_batched_tokens": profile.max_num_batched_tokens,
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
        }
    }


def replay_metrics(summary: Mapping[str, Any]) -> Metrics:
    """M of one Dynamo replay report summary (its times are milliseconds)."""
    return {
        "hit_rate": float(summary["prefix_cache_reused_ratio"]),
        "ttft_p50": float(summary["median_ttft_ms"]) / 1000,
        "ttft_p99": float(summary["p99_ttft_ms"]) / 1000,
    }


def run_dynamo(trace: Path, mode: str, profile: EngineProfile, workers: int) -> Metrics:
    """One Dynamo offline replay of `trace` (raises DynamoMissing without the package)."""
    os.environ.setdefault("DYN_LOG", "warn")  # the selector logs every decision at info
    try:
        from dynamo.replay import run_trace_replay
    except ImportError as e:
        raise DynamoMissing(INSTALL_HINT) from e
    report = run_trace_replay(
        str(trace),
        router_mode=mode,
        num_workers=workers,
        trace_block_size=TRACE_BLOCK_TOKENS,
        replay_mode="offline",
        extra_engine_args=mocker_engine_args(profile),
    )
    return replay_metrics(report.summary)


def run_kvgate(trace: Path, policy: str, profile: EngineProfile, workers: int, seed: int) -> Metrics:
    """The kvgate simulator on `trace` at its own timestamps (no rescaling to a load)."""
    metrics = run_policy(policy, load_trace(trace), profile.name, workers, seed).metrics
    return {key: float(metrics[key]) for key in METRIC_KEYS}  # type: ignore[arg-type]


DynamoRunner = Callable[[Path, str, EngineProfile, int], Metrics]


def cross_check(
    trace: Path,
    profile: EngineProfile,
    workers: int = 8,
    seed: int = 1,
    dynamo: DynamoRunner = run_dynamo,
) -> dict[str, dict[str, Metrics]]:
    """The JSON document of the module docstring."""
    return {
        "dynamo_replay": {mode: dynamo(trace, mode, profile, workers) for mode in DYNAMO_MODES},
        "kvgate_sim": {p: run_kvgate(trace, p, profile, workers, seed) for p in KVGATE_POLICIES},
    }


def comparison(doc: Mapping[str, Mapping[str, Metrics]]) -> dict[str, float | bool]:
    """Differences against the goal: hit-rate gaps in points, and the rr ÷ kv TTFT p50 ratios."""
    dyn, ours = doc["dynamo_replay"], doc["kvgate_sim"]
    rr_gap = 100 * (ours["round_robin"]["hit_rate"] - dyn["round_robin"]["hit_rate"])
    kv_gap = 100 * (ours["dynamo"]["hit_rate"] - dyn["kv_router"]["hit_rate"])
    dyn_ratio = dyn["round_robin"]["ttft_p50"] / dyn["kv_router"]["ttft_p50"]
    our_ratio = ours["round_robin"]["ttft_p50"] / ours["dynamo"]["ttft_p50"]
    return {
        "rr_hit_gap_points": rr_gap,
        "kv_hit_gap_points": kv_gap,
        "dynamo_rr_over_kv_p50": dyn_ratio,
        "kvgate_rr_over_kv_p50": our_ratio,
        "ratio_of_ratios": our_ratio / dyn_ratio,
        "rr_hit_ok": abs(rr_gap) <= HIT_GOAL_POINTS,
        "kv_hit_ok": abs(kv_gap) <= HIT_GOAL_POINTS,
        # each within ±30 % of the other's
        "ratio_ok": abs(our_ratio - dyn_ratio) <= RATIO_GOAL * min(our_ratio, dyn_ratio),
    }


def render(trace: Path, doc: Mapping[str, Mapping[str, Metrics]]) -> str:
    dyn, ours = doc["dynamo_replay"], doc["kvgate_sim"]
    c = comparison(doc)
    rows = [
        f"{trace.name}: hit rate, TTFT p50 / p99 (s)",
        f"{'':<22}{'Dynamo replay':>30}{'kvgate sim':>30}",
    ]
    for label, d, k in (("KV router", "kv_router", "dynamo"), ("round robin", "round_robin", "round_robin")):
        a, b = dyn[d], ours[k]
        rows.append(
            f"{label:<22}{a['hit_rate']:>10.1%}{a['ttft_p50']:>10.3f}{a['ttft_p99']:>10.3f}"
            f"{b['hit_rate']:>10.1%}{b['ttft_p50']:>10.3f}{b['ttft_p99']:>10.3f}"
        )
    for metric in ("ttft_p50", "ttft_p99"):
        rows.append(
            f"{'kv / rr ' + metric:<22}{dyn['kv_router'][metric] / dyn['round_robin'][metric]:>30.3f}"
            f"{ours['dynamo'][metric] / ours['round_robin'][metric]:>30.3f}"
        )

    def verdict(ok: object) -> str:
        return "ok" if ok else "OUTSIDE GOAL"

    rows += [
        f"round-robin hit gap {c['rr_hit_gap_points']:+.1f} points ({verdict(c['rr_hit_ok'])}, goal ±3)",
        f"KV-router hit gap {c['kv_hit_gap_points']:+.1f} points ({verdict(c['kv_hit_ok'])}, goal ±3)",
        f"rr ÷ kv TTFT p50: Dynamo {c['dynamo_rr_over_kv_p50']:.2f}, kvgate {c['kvgate_rr_over_kv_p50']:.2f}"
        f" ({verdict(c['ratio_ok'])}, goal within ±30 % of each other)",
    ]
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.xcheck_dynamo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("trace", type=Path, help="a Mooncake JSONL trace (512-token hash blocks)")
    parser.add_argument("--json", type=Path, required=True, metavar="PATH", help="write the results here")
    parser.add_argument(
        "--profile",
        default=MATCHED_PROFILE,
        help="the kvgate simulator's engine profile; the mocker gets its block size and capacity "
        f"(default {MATCHED_PROFILE}: the mocker's own timing model in our step model's terms)",
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    try:
        profile = load_profile(args.profile)
        load_trace(args.trace, limit=1)  # a bad trace fails before any replay
        doc = cross_check(args.trace, profile, args.workers, args.seed)
    except (DynamoMissing, TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(render(args.trace, doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
