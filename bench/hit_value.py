"""Why kvgate moves a prefix off its holder at overload where SGLang keeps it (issue 11, 9 item 3).

    python -m bench.hit_value [--workloads tenants,mooncake,weka] [--load 2] [--requests 300]
        [--workers 4] [--num-gpu-blocks 2500] [--top 12]

Each workload is built exactly as `kvgate bench live` and `python -m bench.queue_guard` build it. The
kvgate policy's `decide` is wrapped to record what it saw: every worker's believed hit, the candidates
the filters left, the cost parts of the winner and of the best holder (the worker with the longest
believed prefix). Each decision is one of

  keep     the winner holds the longest believed prefix (or as long as any);
  move     a holder existed and was a candidate, the winner holds less: the cost model chose it;
  filter   a holder existed but a filter removed it (hard overload, replica cap, sticky hold);
  miss     nobody held any of it.

For a `move` it names the term that won (`wait`: the holder's queued prefill is more than the winner's
TTFT + miss work; `replica`: the hot-prefix replica investment zeroed the winner's miss work) and
what the move cost: the engine's actual cached tokens on the winner against the holder's believed hit
(hit tokens lost), and the KV the miss's blocks took on the winner. The same requests through the
SGLang model (bench/peers/sglang.py) give its actual hit per request, so both runs' hit rates are
side by side. A diagnostic, outside bench/sim (it does not change the grid's cache keys).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.live import write_profile
from bench.live_workloads import at_load, build, cap_output
from bench.sim.cluster import SimResult, simulate
from bench.sim.policy_router import PolicyRouter
from bench.sim.profiles import load_profile
from bench.sim.registry import make_router
from bench.sim.types import SimRequest
from bench.stats import percentile
from bench.trace_cell import RecordingPolicy
from policy.config import RoutingConfig
from policy.kvgate import KvgatePolicy
from policy.profile import run_filters
from policy.scorers import effective_hit_tokens
from policy.types import Decision, RequestView, WorkerView


@dataclass(slots=True)
class Seen:
    """One kvgate decision as the router saw it."""

    t: float
    prompt: int
    kind: str  # keep, move, filter, miss
    why: str  # the winning term of a move, or the filter that removed the holder
    reason: str
    winner: str
    holder: str | None
    winner_hit: int
    holder_hit: int
    winner_parts: dict[str, float] = field(default_factory=dict)
    holder_parts: dict[str, float] = field(default_factory=dict)
    winner_wait: float = 0.0
    holder_wait: float = 0.0
    busy: float = 0.0
    prefix_rate: float = 0.0


def _observe(
    p: KvgatePolicy, req: RequestView, workers: Sequence[WorkerView], d: Decision, now_s: float
) -> Seen:
    assert d.worker is not None
    gain = p.config.min_cache_gain
    hits = {w.id: effective_hit_tokens(req, w.id, gain) for w in workers}
    best = max(hits.values())
    by_id = {w.id: w for w in workers}
    cands, narrowed, _ = run_filters(p.filters(), req, workers, now_s)
    cand_ids = {w.id for w in cands}
    holders = [w for w in hits if hits[w] == best and best > 0]
    holder = min(holders, key=lambda h: d.scores.get(h, {}).get("cost", 1e9)) if holders else None
    model = p.ttft.model
    seen = Seen(
        t=now_s,
        prompt=req.prompt_tokens,
        kind="keep",
        why="",
        reason=d.reason,
        winner=d.worker,
        holder=holder,
        winner_hit=hits[d.worker],
        holder_hit=best,
        winner_parts=dict(d.scores[d.worker]),
        winner_wait=model.wait_s(by_id[d.worker]),
        busy=p.cost.busy_weight(req, cands),
        prefix_rate=req.prefix_rate,
    )
    if best <= 0:
        seen.kind = "miss"
    elif hits[d.worker] < best:
        assert holder is not None
        seen.holder_wait = model.wait_s(by_id[holder])
        if not any(h in cand_ids for h in holders):
            seen.kind, seen.why = "filter", "+".join(narrowed) or "?"
        else:
            seen.kind = "move"
            seen.holder_parts = dict(d.scores[holder])
            seen.why = "replica" if "hot prefix" in d.reason else "wait"
    return seen


def run_kvgate(
    requests: Sequence[SimRequest], profile_path: Path, workers: int, config: RoutingConfig
) -> tuple[SimResult, dict[str, Seen]]:
    profile = load_profile(profile_path)
    router = PolicyRouter("kvgate", config, 1)
    rec = RecordingPolicy(KvgatePolicy(config), _observe)
    router.policy = rec
    return simulate(requests, router, profile, workers), rec.seen


def summary(result: SimResult, slo_s: float) -> dict[str, float]:
    # (arrival, first token, finish) of each request that finished
    served = [
        (r, r.first_token_s, r.finish_s)
        for r in result.records
        if r.first_token_s is not None and r.finish_s is not None
    ]
    ttft = sorted(first - r.arrival_s for r, first, _ in served)
    start = min(r.arrival_s for r in result.records)
    span = max(finish for _, _, finish in served) - start
    tokens = sum(r.input_tokens for r, _, _ in served)
    return {
        "hit": sum(r.cached_tokens for r, _, _ in served) / tokens if tokens else 0.0,
        "p50": percentile(ttft, 50),
        "p99": percentile(ttft, 99),
        "rps": len(served) / span,
        "good": sum(1 for t in ttft if t <= slo_s) / span,
    }


def delayed(requests: Sequence[SimRequest], jitter_s: float, seed: int) -> list[SimRequest]:
    """Every arrival later by a uniform [0, jitter_s] (the client's send lag), in arrival order again."""
    if jitter_s <= 0:
        return list(requests)
    rng = random.Random(seed)
    moved = [replace(r, arrival_s=r.arrival_s + rng.uniform(0.0, jitter_s)) for r in requests]
    return sorted(moved, key=lambda r: r.arrival_s)


def report(name: str, requests: Sequence[SimRequest], profile_path: Path, args: argparse.Namespace) -> None:
    config = RoutingConfig()
    kv, seen = run_kvgate(requests, profile_path, args.workers, config)
    sg = simulate(requests, make_router("sglang", 1), load_profile(profile_path), args.workers)
    a, b = summary(kv, args.slo_ttft), summary(sg, args.slo_ttft)
    print(f"\n== {name} at {args.load:g}x: {len(requests)} requests, {args.workers} workers")
    for label, figures in (("kvgate", a), ("sglang", b)):
        print(
            f"  {label:7} hit {figures['hit']:.1%}  TTFT p50 {figures['p50']:.3f} "
            f"p99 {figures['p99']:.3f}  req/s {figures['rps']:.2f}  goodput {figures['good']:.2f}"
        )
    kinds = Counter(s.kind for s in seen.values())
    whys = Counter((s.kind, s.why) for s in seen.values() if s.kind in ("move", "filter"))
    by_id = {str(r.id): r for r in kv.records}
    sg_by_id = {str(r.id): r for r in sg.records}
    print("  kvgate decisions: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    print(
        "  moves and filtered holders by cause: "
        + ", ".join(f"{k}/{w} {n}" for (k, w), n in whys.most_common())
    )
    # what the moves cost: believed hit on the holder vs the actual engine hit on the winner
    for kind in ("keep", "move", "filter", "miss"):
        ids = [i for i, s in seen.items() if s.kind == kind]
        if not ids:
            continue
        believed = sum(seen[i].holder_hit for i in ids)
        actual = sum(by_id[i].cached_tokens for i in ids)
        sg_actual = sum(sg_by_id[i].cached_tokens for i in ids)
        prompt = sum(seen[i].prompt for i in ids)
        print(
            f"    {kind:6} {len(ids):4d} req, prompt {prompt:8d} tok: holder's believed hit {believed:8d}, "
            f"kvgate actual {actual:8d} ({actual / prompt:.1%}), sglang actual on the same requests "
            f"{sg_actual:8d} ({sg_actual / prompt:.1%})"
        )
    moves = sorted((s for s in seen.values() if s.kind == "move"), key=lambda s: s.t)
    if moves:
        gain = [s.holder_wait - s.winner_wait for s in moves]
        miss = [s.winner_parts["miss-work"] for s in moves]
        busy = [s.busy for s in moves]
        p50 = {
            "gain": percentile(sorted(gain), 50),
            "miss": percentile(sorted(miss), 50),
            "busy": percentile(sorted(busy), 50),
            "rate": percentile(sorted(s.prefix_rate for s in moves), 50),
        }
        print(
            f"  moves: holder wait − winner wait p50 {p50['gain']:.3f} s; winner's miss work p50 "
            f"{p50['miss']:.3f} s; busy p50 {p50['busy']:.2f}, max {max(busy):.2f}; "
            f"prefix rate p50 {p50['rate']:.2f}/s"
        )
        print(
            "     t   prompt  why      winner(hit, ttft, miss, cost)        "
            "holder(hit, ttft, miss, cost)  busy  actual"
        )
        for s in moves[: args.top]:
            w, h = s.winner_parts, s.holder_parts
            rid = next(i for i, x in seen.items() if x is s)
            print(
                f"  {s.t:5.2f} {s.prompt:6d}  {s.why:7} {s.winner}({s.winner_hit:5d}, "
                f"{w['predicted-ttft']:.3f}, {w['miss-work']:.3f}, {w['cost']:.3f})  "
                f"{s.holder}({s.holder_hit:5d}, "
                f"{h['predicted-ttft']:.3f}, {h['miss-work']:.3f}, {h['cost']:.3f})  {s.busy:4.2f}  "
                f"{by_id[rid].cached_tokens:5d}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hit_value", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="tenants,mooncake,weka")
    p.add_argument("--load", type=float, default=2.0)
    p.add_argument("--requests", default="300,200,60", help="per workload, or one count for all")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--num-gpu-blocks", default="2500,8000,8000", help="per workload, or one for all")
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--profile", default="h100-llama3.1-8b")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--top", type=int, default=12)
    p.add_argument(
        "--jitter-ms", type=float, default=0.0, help="delay each send by up to this (bench.live_vs_sim)"
    )
    p.add_argument("--replay", type=int, default=0, help="seed of the send delays")
    p.add_argument("--out", type=Path, default=Path("out/hit_value"))
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    names = [w for w in args.workloads.split(",") if w]
    counts = [int(x) for x in args.requests.split(",")]
    blocks = [int(x) for x in args.num_gpu_blocks.split(",")]
    for i, name in enumerate(names):
        n, nb = counts[min(i, len(counts) - 1)], blocks[min(i, len(blocks) - 1)]
        args.out.mkdir(parents=True, exist_ok=True)
        path = write_profile(load_profile(args.profile), nb, args.out / f"profile-{nb}.toml")
        base = cap_output(build(name, args.seed, n), args.max_output)
        requests = at_load(base, load_profile(path), args.workers, args.load)
        report(name, delayed(requests, args.jitter_ms / 1000, args.replay), path, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
