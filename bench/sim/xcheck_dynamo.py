"""Cross-check the simulator against NVIDIA Dynamo's own offline trace replay.

    python -m bench.sim.xcheck_dynamo TRACE --json PATH [--profile NAME] [--workers N] [--seed N]
    python -m bench.sim.xcheck_dynamo --engine-check --json PATH [--profile NAME]

Dynamo's replay (`dynamo.replay.run_trace_replay`, ai-dynamo 1.6.1) runs Dynamo's real KV router
(its Rust selector) or round robin in front of its mocker engine, in virtual time. This runs that
replay with `router_mode="kv_router"` and `"round_robin"`, and the kvgate simulator with its
`dynamo` (bench/peers/dynamo.py, our re-implementation) and `round_robin` policies, on the same
Mooncake trace at its own timestamps, both engines matched in capacity and speed. The mocker gets
the profile's KV block size, KV blocks per worker, max_num_seqs and max_num_batched_tokens, and keeps
its default timing model (a polynomial of the step's new prompt tokens and KV occupancy). Our
simulator runs on profile dynamo-mocker-1.6.1, that polynomial written in our step model's terms
(bench/sim/profiles/dynamo-mocker-1.6.1.toml): the mocker's timing options cannot express our
profiles' attention-to-context cost, while our step model holds the mocker's polynomial up to a
linearisation (docs/SIMULATOR.md, "Cross-check against Dynamo"). `--profile h100-llama3.1-8b` runs
our side on its H100 calibration instead, the mocker unchanged.

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
import tempfile
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


def replay_summary(trace: Path, mode: str, profile: EngineProfile, workers: int) -> Mapping[str, Any]:
    """One Dynamo offline replay of `trace`: its report summary (raises DynamoMissing without the package)."""
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
    summary: Mapping[str, Any] = report.summary
    return summary


def run_dynamo(trace: Path, mode: str, profile: EngineProfile, workers: int) -> Metrics:
    """M of one Dynamo offline replay of `trace`."""
    return replay_metrics(replay_summary(trace, mode, profile, workers))


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


# --engine-check: one worker, round robin; one request alone per prompt length, then an overload
ALONE_PROMPTS = (512, 2048, 4096, 8192, 16384, 40960)
ALONE_OUTPUT = 201
OVERLOAD = {"requests": 40, "prompt": 6000, "output": 150, "gap_ms": 60}


def engine_check_traces(directory: Path) -> dict[str, Path]:
    """Mooncake traces that show the engines' speed: `alone-L` (one L-token prompt on an idle worker)
    and `overload` (distinct prompts arriving faster than one worker serves them)."""
    traces: dict[str, Path] = {}

    def write(name: str, rows: list[dict[str, Any]]) -> None:
        traces[name] = directory / f"{name}.jsonl"
        traces[name].write_text("".join(json.dumps(row) + "\n" for row in rows))

    for tokens in ALONE_PROMPTS:
        blocks = list(range(-(-tokens // TRACE_BLOCK_TOKENS)))
        write(
            f"alone-{tokens}",
            [{"timestamp": 0, "input_length": tokens, "output_length": ALONE_OUTPUT, "hash_ids": blocks}],
        )
    n, prompt, output, gap = (OVERLOAD[k] for k in ("requests", "prompt", "output", "gap_ms"))
    per = -(-prompt // TRACE_BLOCK_TOKENS)
    write(
        "overload",
        [
            {
                "timestamp": gap * i,
                "input_length": prompt,
                "output_length": output,
                "hash_ids": list(range(per * i, per * (i + 1))),
            }
            for i in range(n)
        ],
    )
    return traces


SummaryRunner = Callable[[Path, str, EngineProfile, int], Mapping[str, Any]]


def engine_check(
    profile: EngineProfile, directory: Path, dynamo: SummaryRunner = replay_summary
) -> dict[str, dict[str, Metrics]]:
    """TTFT p50/p99 and e2e p50 (seconds) of both engines on engine_check_traces, one worker."""
    out: dict[str, dict[str, Metrics]] = {}
    for name, trace in engine_check_traces(directory).items():
        s = dynamo(trace, "round_robin", profile, 1)
        ours = run_policy("round_robin", load_trace(trace), profile.name, 1, 1).metrics
        out[name] = {
            "dynamo": {
                "ttft_p50": float(s["median_ttft_ms"]) / 1000,
                "ttft_p99": float(s["p99_ttft_ms"]) / 1000,
                "e2e_p50": float(s["median_e2e_latency_ms"]) / 1000,
            },
            "kvgate": {key: float(ours[key]) for key in ("ttft_p50", "ttft_p99", "e2e_p50")},  # type: ignore[arg-type]
        }
    return out


def render_engine_check(profile: EngineProfile, doc: Mapping[str, Mapping[str, Metrics]]) -> str:
    rows = [
        f"engines on one worker (mocker: its own timing; kvgate: profile {profile.name}), seconds",
        f"{'':<16}{'Dynamo mocker':>30}{'kvgate engine':>30}",
        f"{'':<16}" + f"{'ttft p50':>10}{'ttft p99':>10}{'e2e p50':>10}" * 2,
    ]
    for name, sides in doc.items():
        cells = "".join(
            f"{sides[side][k]:>10.4f}"
            for side in ("dynamo", "kvgate")
            for k in ("ttft_p50", "ttft_p99", "e2e_p50")
        )
        rows.append(f"{name:<16}{cells}")
    return "\n".join(rows)


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
    parser.add_argument("trace", type=Path, nargs="?", help="a Mooncake JSONL trace (512-token hash blocks)")
    parser.add_argument("--json", type=Path, required=True, metavar="PATH", help="write the results here")
    parser.add_argument(
        "--profile",
        default=MATCHED_PROFILE,
        help="the kvgate simulator's engine profile; the mocker gets its block size and capacity "
        f"(default {MATCHED_PROFILE}: the mocker's own timing model in our step model's terms)",
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--engine-check",
        action="store_true",
        help="instead of a trace: both engines on one worker, one request alone per prompt length "
        "and an overload (how closely the profile matches the mocker's speed)",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.engine_check:
        return _engine_check_main(args.profile, args.json)
    if args.trace is None:
        parser.error("TRACE is required (or --engine-check)")
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


def _engine_check_main(profile_name: str, out: Path) -> int:
    try:
        profile = load_profile(profile_name)
        with tempfile.TemporaryDirectory(prefix="xcheck-engines-") as tmp:
            doc = engine_check(profile, Path(tmp))
    except (DynamoMissing, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(render_engine_check(profile, doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
