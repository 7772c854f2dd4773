"""vllm-router `cache_aware` (PyPI vllm-router 0.1.17): token-level, per-worker prefix match, R load.

Sources (shared/reference/PEERS.md §1.2): `vllm-project/router: src/policies/cache_aware.rs`, a fork
of SGLang's gateway. Unlike SGLang's union-tree match (bench/peers/sglang.py) it tokenizes the prompt
through each worker's `/v1/chat/completions/render` and matches it against each worker's own
subtree, so a prefix several workers hold counts for each of them, and ties between equally good
holders go to the least loaded one instead of the prefix's first owner.

Decision (loads = router-side in-flight requests over the healthy workers):
1. `rate[w]` = leading tokens of the prompt in w's subtree / prompt tokens;
2. if not imbalanced (`max - min > 64 and max > 1.5 * min`) and `max(rate) > 0.3`: the least loaded
   of the workers with the best rate; otherwise the least loaded worker overall;
3. the prompt is inserted for the chosen worker.
Defaults: cache_threshold 0.3, balance 64 / 1.5, eviction every 120 s to 2^25 chars (8 hex chars per
token, so 2^22 tokens) per worker. Simulation: trace-block granularity (a partial match inside a
block counts 0 tokens), weights in tokens.
"""

from __future__ import annotations

from bench.peers.common import TenantBlockTree, first_argmin
from bench.sim.types import ClusterView, NoFeedback, SimRequest

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
MAX_TREE_SIZE_TOKENS = 2**25 // 8
EVICTION_INTERVAL_S = 120.0


class VllmRouter(NoFeedback):
    def __init__(self, name: str = "vllm_router") -> None:
        self.name = name
        self.tree = TenantBlockTree()
        self._next_eviction_s: float | None = None
        self.last_reason = ""

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        workers = list(cluster.worker_ids)
        for w in workers:
            self.tree.add_tenant(w)
        if self._next_eviction_s is None:
            self._next_eviction_s = now_s + EVICTION_INTERVAL_S
        while now_s >= self._next_eviction_s:
            self.tree.evict(MAX_TREE_SIZE_TOKENS)
            self._next_eviction_s += EVICTION_INTERVAL_S
        load = {w: cluster.inflight(w) for w in workers}
        lo, hi = min(load.values()), max(load.values())
        total = sum(req.block_tokens)
        rate = {w: self.tree.match_tenant(req.block_ids, w) / total if total else 0.0 for w in workers}
        best = max(rate.values())
        imbalanced = hi - lo > BALANCE_ABS_THRESHOLD and hi > lo * BALANCE_REL_THRESHOLD
        if not imbalanced and best > CACHE_THRESHOLD:
            chosen = first_argmin([w for w in workers if rate[w] == best], key=load.__getitem__)
            self.last_reason = "cache hit"
        else:
            chosen = first_argmin(workers, key=load.__getitem__)
            self.last_reason = "imbalanced" if imbalanced else "miss: least load"
        self.tree.insert(req.block_ids, req.block_tokens, chosen)
        return chosen


def make_router(seed: int) -> VllmRouter:
    """vllm-router 0.1.17 `cache_aware`. Deterministic; `seed` unused."""
    del seed
    return VllmRouter()
