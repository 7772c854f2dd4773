"""SGLang router `cache_aware` policy: approximate char radix tree of routed prompts, R load.

Sources (shared/reference/PEERS.md §1.1, STYLE.md §3): `sgl-project/sglang:
sgl-router/src/policies/{cache_aware,tree}.rs` (renamed `sgl-model-gateway/` 2025-12-05); PyPI
`sglang-router` 0.3.2 (upstream policies as of 2026-02-12; copy with history in
`radixark/sgl-router-for-miles: src/policies/*`); miss-path change sgl-project/sglang PR #14650
(2025-12-09).

Decision, top-down (loads = router-side in-flight requests, R, over all workers):
1. imbalance `max - min > balance_abs_threshold and max > min * balance_rel_threshold` -> least load;
2. else match the prompt on the union tree; `rate = matched chars / prompt chars`;
   `rate > cache_threshold` -> the matched node's `last_tenant` (first worker that inserted it);
3. else (miss) -> least load (current, >= Dec 2025) or the tenant with the smallest tree (legacy).
Then the prompt is inserted for the chosen worker. Ties go to registry order (`first_argmin`).
Defaults (Python launcher): `cache_threshold` 0.3, `balance_abs_threshold` 64, `balance_rel_threshold`
1.5, `max_tree_size` 2^26 chars per worker, `eviction_interval` 60 s (of virtual time here).

Simulation assumptions: the prompt text is 4 chars per token and trace block i is `4 *
block_tokens[i]` chars; distinct block ids differ in their first char, so a partial match inside a
block counts 0 chars (real text would give a few more matched chars: rates here are a lower bound).
Match-time touches (p = 1/8) are omitted: the insert right after the decision touches the path.
"""

from __future__ import annotations

from bench.peers.common import TenantBlockTree, first_argmin
from bench.sim.types import ClusterView, NoFeedback, SimRequest
from policy.prefix import CHARS_PER_TOKEN

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
MAX_TREE_SIZE_CHARS = 2**26
EVICTION_INTERVAL_S = 60.0


class SglangRouter(NoFeedback):
    """`cache_aware` with the current (least-load) or legacy (smallest-tree) miss rule."""

    def __init__(
        self,
        name: str = "sglang",
        least_load_on_miss: bool = True,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
        max_tree_size_chars: int = MAX_TREE_SIZE_CHARS,
        eviction_interval_s: float = EVICTION_INTERVAL_S,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be between 0 and 1, not {cache_threshold}")
        if eviction_interval_s <= 0:
            raise ValueError(f"eviction_interval_s must be > 0, not {eviction_interval_s}")
        self.name = name
        self.least_load_on_miss = least_load_on_miss
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size_chars = max_tree_size_chars
        self.eviction_interval_s = eviction_interval_s
        self.tree = TenantBlockTree()
        self._next_eviction_s: float | None = None
        self.last_reason = ""  # why the last request went where it did (for tests and debugging)

    def _maybe_evict(self, now_s: float) -> None:
        if self._next_eviction_s is None:
            self._next_eviction_s = now_s + self.eviction_interval_s
        while now_s >= self._next_eviction_s:
            self.tree.evict(self.max_tree_size_chars)
            self._next_eviction_s += self.eviction_interval_s

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        workers = list(cluster.worker_ids)
        for w in workers:
            self.tree.add_tenant(w)
        self._maybe_evict(now_s)
        load = {w: cluster.inflight(w) for w in workers}
        lo, hi = min(load.values()), max(load.values())
        block_chars = [CHARS_PER_TOKEN * n for n in req.block_tokens]
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            chosen = first_argmin(workers, key=load.__getitem__)
            self.last_reason = "imbalanced"
        else:
            total_chars = sum(block_chars)
            tenant, matched = self.tree.match(req.block_ids)
            rate = matched / total_chars if total_chars else 0.0
            if rate > self.cache_threshold and tenant is not None:
                if tenant not in load:  # matched a worker that left: forget it, fall back
                    self.tree.remove_tenant(tenant)
                    self.last_reason = "tenant gone"
                    return workers[0]
                chosen = tenant
                self.last_reason = "cache hit"
            elif self.least_load_on_miss:
                chosen = first_argmin(workers, key=load.__getitem__)
                self.last_reason = "miss: least load"
            else:
                chosen = self.tree.smallest_tenant(workers)
                self.last_reason = "miss: smallest tree"
        self.tree.insert(req.block_ids, block_chars, chosen)
        return chosen


def make_router(seed: int) -> SglangRouter:
    """Current `cache_aware` (sglang-router 0.3.2: miss -> least load). Deterministic; `seed` unused."""
    del seed
    return SglangRouter(name="sglang", least_load_on_miss=True)


def make_legacy_router(seed: int) -> SglangRouter:
    """Pre-Dec-2025 `cache_aware` (miss -> smallest tree, PR #14650 changed it). `seed` unused."""
    del seed
    return SglangRouter(name="sglang_legacy", least_load_on_miss=False)
