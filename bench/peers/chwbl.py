"""Consistent hashing with bounded loads (CHWBL) on the request's leading prefix.

Sources (shared/reference/PEERS.md §1.9): Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
Bounded Loads", SODA 2018; HAProxy `hash-balance-factor`; Envoy `hash_balance_factor`;
`substratusai/kubeai` API types (`PrefixHash`: key = adapter + first 100 chars, `meanLoadPercentage`
125, replication 256).

Algorithm: hash the key onto a ring of `replicas` virtual nodes per worker and walk clockwise to the
first worker whose load after taking this request stays within the bound
`cap = ceil(c * (total_load + 1) / n_workers)`; load = router-side in-flight requests (R).

Parameters: `c` = 1.25 (KubeAI 125 %; > 1), `replicas` = 256 virtual nodes per worker.
Key: KubeAI's first 100 chars ≈ 25 tokens lie inside the first 512-token trace block, so the key is
`block_ids[0]` (PEERS §5); on the Mooncake conversation trace that is one key for all requests, and
CHWBL degenerates to bounded-load spill along one ring walk. A request without blocks hashes its id.
The ring hash is blake2b-64 (deterministic across processes); the seed is unused (CHWBL has no randomness).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from bench.peers.common import hash64
from bench.sim.types import ClusterView, NoFeedback, SimRequest

DEFAULT_C = 1.25
DEFAULT_REPLICAS = 256


class ChwblRouter(NoFeedback):
    """Ring walk past workers above ceil(c * average load)."""

    name = "chwbl"

    def __init__(self, c: float = DEFAULT_C, replicas: int = DEFAULT_REPLICAS) -> None:
        if c <= 1.0:
            raise ValueError(f"c must be > 1, not {c}")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, not {replicas}")
        self.c = c
        self.replicas = replicas
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []
        self._walks: dict[int, list[str]] = {}  # key -> clockwise order (few distinct keys per trace)

    def _ring(self, workers: Sequence[str]) -> None:
        """(Re)build the ring when the worker set changes."""
        key = tuple(workers)
        if key == self._ring_for:
            return
        points = sorted((hash64(f"{w}#{i}"), w) for w in key for i in range(self.replicas))
        self._points = [p for p, _ in points]
        self._owners = [w for _, w in points]
        self._ring_for = key
        self._walks = {}

    def walk(self, key: int, workers: Sequence[str]) -> list[str]:
        """Distinct workers in clockwise order from the key's position on the ring."""
        self._ring(workers)
        cached = self._walks.get(key)
        if cached is not None:
            return cached
        n = len(self._points)
        start = bisect.bisect_left(self._points, key) % n
        seen: dict[str, None] = {}
        for i in range(n):
            w = self._owners[(start + i) % n]
            if w not in seen:
                seen[w] = None
                if len(seen) == len(workers):
                    break
        order = list(seen)
        if len(self._walks) < 100_000:
            self._walks[key] = order
        return order

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        workers = cluster.worker_ids
        key = hash64(f"block:{req.block_ids[0]}") if req.block_ids else hash64(f"req:{req.id}")
        load = {w: cluster.inflight(w) for w in workers}
        cap = math.ceil(self.c * (sum(load.values()) + 1) / len(workers))
        for w in self.walk(key, workers):
            if load[w] + 1 <= cap:
                return w
        # unreachable with c > 1 (some worker is always at or below the mean), kept as a guard
        return min(workers, key=lambda w: load[w])


def make_router(seed: int) -> ChwblRouter:
    """CHWBL with KubeAI defaults (c = 1.25, 256 virtual nodes); deterministic, `seed` unused."""
    del seed
    return ChwblRouter()
