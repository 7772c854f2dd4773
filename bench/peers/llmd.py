"""GIE / llm-d Endpoint Picker: filter stale pods, weighted scorers, max-score picker (random ties).

Sources (shared/reference/PEERS.md §1.3, §1.4; STYLE.md §2): `llm-d/llm-d-inference-scheduler` @520af478
(2026-05): `pkg/epp/scheduling/scheduler_profile.go`, `pkg/epp/config/loader/defaults.go`,
`pkg/epp/framework/plugins/scheduling/{scorer,picker,filter}/*`,
`pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/*`; history in
`kubernetes-sigs/gateway-api-inference-extension` v0.3.0–v1.5.0; precise scorer:
`.../scorer/preciseprefixcache/*`, `llm-d/llm-d-kv-cache` @7be76e11 (score per PR #1107).

Profile: total(e) = Σ weight · clamp01(score(e)), argmax, uniform random among ties (seeded).
* queue-scorer: min-max of scraped `waiting` across candidates, 1.0 for all if equal (M);
* kv-cache-utilization-scorer: 1 − scraped `kv_usage` (M);
* prefix-cache-scorer (approximate, H): matched / total index blocks from the router's own history;
* precise-prefix-cache-scorer (E): min(1, longest cached consecutive prefix / total blocks).
Defaults: approximate = GIE >= v1.2 / llm-d built-in weights queue 2, kv 2, prefix 3; precise = the
llm-d benchmark "precise" profile precise 3, kv 2, queue 2.
Metrics are scraped every 50 ms by the cluster; a pod whose scrape is older than 200 ms is stale
(treated as saturated) and filtered out; if every pod is stale the filter fails open.

Approximate index, mapped per PEERS §5: the prompt text is 4 chars per token, hashed in 64-char (16
token) chained blocks, capped at 256 blocks (the first 4,096 tokens = the first 8 trace blocks),
a chained tail hash for a last partial chunk (2026 rule). A 512-token trace block is 32 index blocks
that share their fate, so the index keys whole trace blocks weighted by their index-block count
(eviction at trace-block granularity: a negligible coarsening). Per-pod LRU capacity =
`num_gpu_blocks` from the pod's KV capacity at 16 tokens per block (`capacity_tokens // 16`; 31,250
when unknown). The block size is fixed at 16 tokens (no auto-tune from the engine's block_size label).
Match walks blocks in order, adding each block to every pod holding it, and stops at the first block
no pod holds. All blocks are inserted for the chosen pod right after the decision.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from bench.peers.common import cumulative_tokens
from bench.sim.types import ClusterView, NoFeedback, SimRequest

STALE_AFTER_S = 0.2
INDEX_BLOCK_TOKENS = 16  # 64 chars at 4 chars/token
MAX_INDEX_BLOCKS = 256
DEFAULT_LRU_CAPACITY_BLOCKS = 31_250  # (80 - 16) GB / 128 KB per token / 16 tokens
PRECISE_BLOCK_TOKENS = 64  # llm-d precise sample config

APPROX_WEIGHTS = {"queue": 2.0, "kv": 2.0, "prefix": 3.0}
PRECISE_WEIGHTS = {"queue": 2.0, "kv": 2.0, "prefix": 3.0}


def index_blocks(req: SimRequest) -> list[tuple[int, int]]:
    """(trace block id, index blocks it contributes) for the hashed part of the prompt."""
    if req.input_tokens * 4 < 64:  # shorter than one 64-char block: no hashes
        return []
    out: list[tuple[int, int]] = []
    left = MAX_INDEX_BLOCKS * INDEX_BLOCK_TOKENS
    for bid, ntok in zip(req.block_ids, req.block_tokens, strict=True):
        used = min(ntok, left)
        if used <= 0:
            break
        full, tail = divmod(used, INDEX_BLOCK_TOKENS)
        out.append((bid, full + (1 if tail else 0)))
        left -= used
    return out


class ApproxPrefixIndex:
    """`hash -> {pods}` plus a per-pod LRU of hashes (weights in index blocks), blind to engine evictions."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, dict[int, int]] = {}  # pod -> key -> weight, least recent first
        self._used: dict[str, int] = {}

    def match(self, blocks: Sequence[tuple[int, int]]) -> dict[str, int]:
        matched: dict[str, int] = {}
        for key, weight in blocks:
            holders = self._holders.get(key)
            if not holders:
                break
            for pod in holders:
                matched[pod] = matched.get(pod, 0) + weight
        return matched

    def insert(self, blocks: Sequence[tuple[int, int]], pod: str, capacity: int) -> None:
        lru = self._lru.setdefault(pod, {})
        used = self._used.get(pod, 0)
        for key, weight in blocks:
            old = lru.pop(key, None)
            if old is None:
                self._holders.setdefault(key, set()).add(pod)
                used += weight
            lru[key] = weight
        while used > capacity and lru:
            key = next(iter(lru))
            used -= lru.pop(key)
            holders = self._holders[key]
            holders.discard(pod)
            if not holders:
                del self._holders[key]
        self._used[pod] = used

    def holds(self, pod: str, key: int) -> bool:
        return key in self._lru.get(pod, {})


class LlmdRouter(NoFeedback):
    """Filter stale pods, score queue / kv / prefix, pick the max (seeded random ties)."""

    def __init__(self, name: str, precise: bool, weights: dict[str, float], rng: random.Random) -> None:
        if set(weights) != {"queue", "kv", "prefix"} or any(v < 0 for v in weights.values()):
            raise ValueError(f"weights must be queue, kv, prefix >= 0, not {weights}")
        self.name = name
        self.precise = precise
        self.weights = dict(weights)
        self.rng = rng
        self.index = ApproxPrefixIndex()
        self.last_scores: dict[str, dict[str, float]] = {}  # pod -> scorer -> score (decision log)

    def _prefix_scores(self, req: SimRequest, pods: Sequence[str], cluster: ClusterView) -> dict[str, float]:
        if self.precise:
            total = req.input_tokens // PRECISE_BLOCK_TOKENS
            if total == 0:
                return dict.fromkeys(pods, 0.0)
            cum = cumulative_tokens(req)
            out = {}
            for p in pods:
                cached = cum[min(cluster.cached_prefix_blocks(p, req), len(req.block_ids))]
                out[p] = min(1.0, (cached // PRECISE_BLOCK_TOKENS) / total)
            return out
        blocks = index_blocks(req)
        total = sum(w for _, w in blocks)
        if total == 0:
            return dict.fromkeys(pods, 0.0)
        matched = self.index.match(blocks)
        return {p: matched.get(p, 0) / total for p in pods}

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        pods = list(cluster.worker_ids)
        scraped = {p: cluster.scraped(p) for p in pods}
        fresh = [p for p in pods if now_s - scraped[p].at_s <= STALE_AFTER_S]
        candidates = fresh or pods  # fail open
        waiting = [scraped[p].waiting for p in candidates]
        lo, hi = min(waiting), max(waiting)
        prefix = self._prefix_scores(req, candidates, cluster)
        w = self.weights
        totals: dict[str, float] = {}
        self.last_scores = {}
        for p in candidates:
            parts = {
                "queue": 1.0 if hi == lo else (hi - scraped[p].waiting) / (hi - lo),
                "kv": 1.0 - scraped[p].kv_usage,
                "prefix": prefix[p],
            }
            parts = {k: min(1.0, max(0.0, v)) for k, v in parts.items()}
            self.last_scores[p] = parts
            totals[p] = w["queue"] * parts["queue"] + w["kv"] * parts["kv"] + w["prefix"] * parts["prefix"]
        best = max(totals.values())
        chosen = self.rng.choice([p for p in candidates if totals[p] == best])
        if not self.precise:
            cap = cluster.capacity_tokens(chosen) // INDEX_BLOCK_TOKENS or DEFAULT_LRU_CAPACITY_BLOCKS
            self.index.insert(index_blocks(req), chosen, cap)
        return chosen

    def on_first_token(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        pass

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        pass


def make_approx_router(seed: int) -> LlmdRouter:
    """llm-d default profile: queue 2, kv-utilization 2, approximate prefix 3."""
    return LlmdRouter("llmd_approx", precise=False, weights=APPROX_WEIGHTS, rng=random.Random(seed))


def make_precise_router(seed: int) -> LlmdRouter:
    """llm-d benchmark "precise" profile: precise prefix 3, kv-utilization 2, queue 2."""
    return LlmdRouter("llmd_precise", precise=True, weights=PRECISE_WEIGHTS, rng=random.Random(seed))
