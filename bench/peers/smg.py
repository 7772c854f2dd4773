"""SMG 1.13 `cache_aware` (PyPI smg 1.13.0, the SGLang router's successor): SGLang's union-tree
match (bench/peers/sglang.py) plus the two defaults SMG added, both read from `smg launch --help`:

- worker overload protection (on by default): a worker whose engine reports >= 8 waiting requests
  or >= 0.8 KV-cache usage (scraped metrics, M) is left out while another worker is under both;
  when every worker is over them the request goes to the least-loaded one;
- the spill gate: a matched worker is skipped for the least-loaded one when its in-flight load
  exceeds the healthy-fleet mean by a margin AND 1.5x the mean; the margin is 64 capped at the
  count's natural swing at that mean, two standard deviations (2 sqrt(mean) for counts), never
  under 4.

Otherwise as SGLang: `rate = matched chars / prompt chars > 0.3` -> the matched node's first owner,
a miss -> least load, and the prompt is inserted for the chosen worker. The KV-usage spread and
ceiling gates are off by default (1.0) and not modelled.
"""

from __future__ import annotations

import math

from bench.peers.common import TenantBlockTree, first_argmin
from bench.sim.types import ClusterView, NoFeedback, SimRequest
from policy.prefix import CHARS_PER_TOKEN

CACHE_THRESHOLD = 0.3
SPILL_ABS = 64
SPILL_REL = 1.5
OVERLOAD_WAITING = 8
OVERLOAD_KV_USAGE = 0.8
MAX_TREE_SIZE_CHARS = 2**26
EVICTION_INTERVAL_S = 60.0


def spill_margin(mean: float) -> float:
    return min(SPILL_ABS, max(4.0, 2.0 * math.sqrt(mean)))


class SmgRouter(NoFeedback):
    def __init__(self, name: str = "smg", overload_protection: bool = True) -> None:
        self.name = name
        self.overload_protection = overload_protection
        self.tree = TenantBlockTree()
        self._next_eviction_s: float | None = None
        self.last_reason = ""

    def _candidates(self, workers: list[str], cluster: ClusterView) -> list[str]:
        if not self.overload_protection:
            return workers
        ok = []
        for w in workers:
            s = cluster.scraped(w)
            if s.waiting < OVERLOAD_WAITING and s.kv_usage < OVERLOAD_KV_USAGE:
                ok.append(w)
        return ok

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        workers = list(cluster.worker_ids)
        for w in workers:
            self.tree.add_tenant(w)
        if self._next_eviction_s is None:
            self._next_eviction_s = now_s + EVICTION_INTERVAL_S
        while now_s >= self._next_eviction_s:
            self.tree.evict(MAX_TREE_SIZE_CHARS)
            self._next_eviction_s += EVICTION_INTERVAL_S
        load = {w: cluster.inflight(w) for w in workers}
        block_chars = [CHARS_PER_TOKEN * n for n in req.block_tokens]
        candidates = self._candidates(workers, cluster)
        if not candidates:
            chosen = first_argmin(workers, key=load.__getitem__)
            self.last_reason = "all overloaded: least load"
        else:
            total = sum(block_chars)
            tenant, matched = self.tree.match(req.block_ids)
            rate = matched / total if total else 0.0
            mean = sum(load.values()) / len(load)
            if rate > CACHE_THRESHOLD and tenant in candidates:
                spill = load[tenant] > mean + spill_margin(mean) and load[tenant] > SPILL_REL * mean
                if spill:
                    chosen = first_argmin(candidates, key=load.__getitem__)
                    self.last_reason = "spill"
                else:
                    chosen = tenant
                    self.last_reason = "cache hit"
            else:
                chosen = first_argmin(candidates, key=load.__getitem__)
                overloaded = rate > CACHE_THRESHOLD and tenant is not None
                self.last_reason = "holder overloaded: least load" if overloaded else "miss: least load"
        self.tree.insert(req.block_ids, block_chars, chosen)
        return chosen


def make_router(seed: int) -> SmgRouter:
    """SMG 1.13 `cache_aware` with its defaults. Deterministic; `seed` unused."""
    del seed
    return SmgRouter()
