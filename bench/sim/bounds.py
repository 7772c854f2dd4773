"""Hit-rate bounds computed from a workload alone, the reference points of every simulator run.

Both are token-weighted (hit tokens / input tokens) and replay requests in arrival order with no timing:
  infinite cache  block i of a request hits iff its id appeared in an earlier request (ids name whole
                  prefixes, so this is "the prefix 0..i was seen before");
  pooled LRU      one LRU holding the cluster's total KV capacity, counted in trace blocks: a request
                  hits its leading run of cached blocks (a prefix cache cannot use block i without 0..i-1),
                  then touches all its blocks tail-first so roots end most recent; no in-flight pinning.
Reference values (shared/reference/PEERS.md §5): conversation trace ideal 37.4 %, LRU 10k blocks 21.6 %,
50k 36.2 %; synthetic ideal 65.1 %, LRU 10k 43.2 %.

And a latency floor: `ttft_floors` = each request's TTFT on an idle worker with an infinite cache (only
the prefix never seen before is computed; the denominator of the per-request "slowdown" metric), and
`ttft_floor` = a percentile of them. No router can bring a TTFT percentile
below it; it tells how much of a trace's tail is prefill of long prompts rather than queueing.

    python -m bench.sim.bounds TRACE.jsonl [--workers 8] [--profile h100-llama3.1-8b]
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from bench.sim.profiles import EngineProfile, load_profile, prefill_time_s
from bench.sim.types import SimRequest


def infinite_cache_hit_rate(requests: Iterable[SimRequest]) -> float:
    """Token hit rate of a cache that never evicts."""
    seen: set[int] = set()
    hit_tokens = total_tokens = 0
    for req in requests:
        for block_id, tokens in zip(req.block_ids, req.block_tokens, strict=True):
            if block_id in seen:
                hit_tokens += tokens
        seen.update(req.block_ids)
        total_tokens += req.input_tokens
    return hit_tokens / total_tokens if total_tokens else 0.0


def pooled_lru_hit_rate(requests: Iterable[SimRequest], capacity_blocks: int) -> float:
    """Token hit rate of one shared LRU of `capacity_blocks` trace blocks."""
    if capacity_blocks <= 0:
        return 0.0
    lru: OrderedDict[int, None] = OrderedDict()  # last = most recently used
    hit_tokens = total_tokens = 0
    for req in requests:
        for block_id, tokens in zip(req.block_ids, req.block_tokens, strict=True):
            if block_id not in lru:
                break
            hit_tokens += tokens
        total_tokens += req.input_tokens
        for block_id in reversed(req.block_ids):  # tail first: block 0 ends most recent
            if block_id in lru:
                lru.move_to_end(block_id)
            else:
                lru[block_id] = None
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit_tokens / total_tokens if total_tokens else 0.0


def pooled_capacity_blocks(workers: int, capacity_tokens_per_worker: int, block_tokens: int = 512) -> int:
    """The cluster's total KV capacity expressed in trace blocks."""
    return workers * capacity_tokens_per_worker // block_tokens


def reusable_working_set_tokens(requests: Sequence[SimRequest]) -> int:
    """Tokens of the distinct blocks that occur in two or more requests (the cache-worthy working set)."""
    counts: dict[int, int] = {}
    tokens_of: dict[int, int] = {}
    for req in requests:
        for block_id, tokens in zip(req.block_ids, req.block_tokens, strict=True):
            counts[block_id] = counts.get(block_id, 0) + 1
            tokens_of[block_id] = max(tokens_of.get(block_id, 0), tokens)
    return sum(tokens_of[b] for b, n in counts.items() if n >= 2)


def ttft_floors(requests: Iterable[SimRequest], profile: EngineProfile) -> list[float]:
    """Each request's TTFT floor, in order: its own uncached prefill on an idle worker with an infinite
    cache, i.e. only the prefix no earlier request had is computed (compulsory misses only)."""
    seen: set[int] = set()
    floors: list[float] = []
    for req in requests:
        hit = 0
        for block_id, tokens in zip(req.block_ids, req.block_tokens, strict=True):
            if block_id not in seen:
                break
            hit += tokens
        seen.update(req.block_ids)
        floors.append(prefill_time_s(profile, max(1, req.input_tokens - hit), hit))
    return floors


def ttft_floor(requests: Iterable[SimRequest], profile: EngineProfile, q: float = 99.0) -> float:
    """Percentile `q` of the per-request TTFT floors (`ttft_floors`)."""
    ttfts = sorted(ttft_floors(requests, profile))
    if not ttfts:
        return 0.0
    pos = (len(ttfts) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ttfts) - 1)
    return ttfts[lo] + (ttfts[hi] - ttfts[lo]) * (pos - lo)


def main(argv: list[str]) -> int:
    from bench.sim.traces import load_trace

    parser = argparse.ArgumentParser(prog="python -m bench.sim.bounds", description="a trace's bounds")
    parser.add_argument("trace")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--profile", default="h100-llama3.1-8b")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    requests = load_trace(args.trace)
    capacity = pooled_capacity_blocks(args.workers, profile.capacity_tokens)
    print(f"{args.trace}: {len(requests)} requests, {args.workers} × {profile.name}")
    print(f"infinite-cache hit rate {infinite_cache_hit_rate(requests):.1%}")
    print(f"pooled-LRU hit rate     {pooled_lru_hit_rate(requests, capacity):.1%}")
    for q in (50.0, 90.0, 99.0):
        print(f"TTFT p{q:.0f} floor         {ttft_floor(requests, profile, q):.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
