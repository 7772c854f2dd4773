"""Index summary size: Redis bytes per worker, and the hit-rate cost of a Bloom filter's false positives.

`kvgate bench index-size [--trace PATH] [--workers 4] [--capacity 8000] [--json PATH]`

1. Redis: one worker's exact index (a ZSET block -> last use, LRU-trimmed to its bound, store/
   index_store.py) filled with N random blocks in an embedded redis-server: `MEMORY USAGE` of the key,
   bytes per entry, and `used_memory` growth; then the same N under a bound of N/4 (the trim keeps it).
   Beside it, a Bloom filter's size for N blocks at 1 % and 0.1 % (policy/bloom.py).
2. Hit-rate cost (a replay of the index, no servers): the Mooncake trace's requests (`hash_ids`, 512-token
   blocks) routed over `--workers` simulated engines, each an LRU cache of `--capacity` blocks. A request
   goes to the worker whose summary matches the most leading blocks (ties: the one with fewest routed).
   Summaries are refreshed from the true caches every `--refresh` requests, either as exact sets or as
   Bloom filters at each false-positive rate, so only the summary kind differs. Reported: the true hit
   rate (blocks found in the chosen engine's cache / all blocks), the predicted-but-absent blocks, and
   the summary bytes per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from policy.bloom import BloomSummary
from store import index_store
from store.redis_server import EmbeddedRedis

DEFAULT_TRACE = "/work/shared/traces/mooncake_fast25/conversation_trace.jsonl"
FP_RATES = (0.1, 0.01, 0.001)


async def redis_sizes(counts: list[int]) -> list[dict[str, Any]]:
    server = EmbeddedRedis().start()
    rng = random.Random(0)
    rows = []
    try:
        redis = aioredis.Redis.from_url(server.url)
        for n in counts:
            for bound in (n, max(1, n // 4)):
                worker = f"w{n}-{bound}"
                before = int((await redis.info("memory"))["used_memory"])
                for start in range(0, n, 1000):
                    hashes = [rng.getrandbits(64) for _ in range(min(1000, n - start))]
                    await index_store.add_blocks(redis, "m", worker, hashes, 1_000 + start, bound)
                await redis.delete(index_store.log_key("m"))  # the op log is capped apart (LOG_MAXLEN)
                key = index_store.index_key("m", worker)
                entries = int(await redis.zcard(key))
                usage = int(await redis.memory_usage(key) or 0)
                grown = int((await redis.info("memory"))["used_memory"]) - before
                rows.append({
                    "blocks_sent": n, "bound": bound, "entries": entries, "memory_usage_bytes": usage,
                    "bytes_per_entry": round(usage / entries, 1), "used_memory_growth": grown,
                    "bloom_1pct_bytes": BloomSummary(entries, 0.01).size_bytes,
                    "bloom_0.1pct_bytes": BloomSummary(entries, 0.001).size_bytes,
                })  # fmt: skip
        await redis.aclose()
    finally:
        server.stop()
    return rows


def leading(summary: set[int] | BloomSummary, hashes: list[int]) -> int:
    """Leading blocks of `hashes` the summary says the worker holds."""
    if isinstance(summary, BloomSummary):
        return summary.match(hashes)
    n = 0
    for h in hashes:
        if h not in summary:
            break
        n += 1
    return n


def replay(
    trace: list[list[int]], workers: int, capacity: int, refresh: int, fp_rate: float | None
) -> dict[str, Any]:
    """Route the trace on per-worker summaries (exact sets, or Bloom filters at `fp_rate`)."""
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(workers)]
    routed = [0] * workers
    summaries: list[Any] = [set() for _ in range(workers)]
    hit = total = phantom = 0
    size = 0
    for i, hashes in enumerate(trace):
        if i % refresh == 0:
            if fp_rate is None:
                summaries = [set(c) for c in caches]
                size = max(len(c) for c in caches) * 8  # 64-bit hashes, before any store overhead
            else:
                summaries = [BloomSummary.of(list(c), fp_rate) for c in caches]
                size = max(s.size_bytes for s in summaries)

        scores = [leading(summaries[w], hashes) for w in range(workers)]
        best = max(range(workers), key=lambda w: (scores[w], -routed[w]))
        routed[best] += 1
        cache = caches[best]
        true = 0
        for h in hashes:
            if h not in cache:
                break
            true += 1
        hit += true
        total += len(hashes)
        phantom += max(0, scores[best] - true) if fp_rate is not None else 0
        for h in reversed(hashes):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return {
        "summary": "exact" if fp_rate is None else f"bloom {fp_rate:g}",
        "hit_rate": round(hit / total, 4),
        "phantom_blocks": phantom,
        "summary_bytes_per_worker": size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench index-size", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="a Mooncake-format JSONL trace (hash_ids)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=8000, help="blocks per simulated engine cache")
    parser.add_argument("--refresh", type=int, default=20, help="requests between summary refreshes")
    parser.add_argument("--requests", type=int, default=0, help="first N requests of the trace (0 = all)")
    parser.add_argument("--redis-blocks", default="1000,10000,65536", help="index sizes to measure in Redis")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    trace = [json.loads(line)["hash_ids"] for line in Path(args.trace).read_text().splitlines() if line]
    if args.requests:
        trace = trace[: args.requests]
    sizes = asyncio.run(redis_sizes([int(n) for n in args.redis_blocks.split(",") if n]))
    print("Redis exact index per worker (ZSET, LRU-bounded):")
    for r in sizes:
        print(f"  {r['blocks_sent']:>6} blocks sent, bound {r['bound']:>6}: {r['entries']:>6} entries, "
              f"{r['memory_usage_bytes']:>8} B ({r['bytes_per_entry']} B/entry), "
              f"used_memory +{r['used_memory_growth']} B; "
              f"Bloom 1% {r['bloom_1pct_bytes']} B, 0.1% {r['bloom_0.1pct_bytes']} B")  # fmt: skip
    runs = [replay(trace, args.workers, args.capacity, args.refresh, fp) for fp in (None, *FP_RATES)]
    print(f"replay of {len(trace)} requests, {args.workers} workers x {args.capacity} blocks, refresh every "
          f"{args.refresh} requests:")  # fmt: skip
    for r in runs:
        print(f"  {r['summary']:<11} hit rate {r['hit_rate']:.4f}  phantom blocks {r['phantom_blocks']:>6}  "
              f"summary {r['summary_bytes_per_worker']} B/worker")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"redis": sizes, "replay": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
