"""Hot prefixes and the two stability figures built on them: `switch_rate` (bench/sim/metrics.py) and
`flap_rate` (counted during the run, from engine truth, by `FlapCounter`).

A request's key is the deepest of its block ids that appeared in an earlier request (its longest
previously seen prefix). The request has a hot prefix if that prefix covers >= 50 % of its input tokens
and some earlier routed request contained the key block no more than `window_s` before it (a prefix
last asked for minutes ago has usually left every cache, and sending it anywhere is no oscillation).

flap_rate = hot-prefix requests sent to a worker whose engine does not hold the prefix while an engine
that does hold it was not overloaded / hot-prefix requests. "Holds" is engine truth at the routing
instant (the leading blocks up to the key are in its prefix cache). A holder is overloaded when the
prefill work already queued on it (`Engine.queued_prefill_tokens`, priced on an idle engine) takes
longer than what its hit saves this request (cold prefill − prefill after the hit): then recomputing
the prefix elsewhere is the cheaper choice, and moving is no flap. Spreading a hot prefix over
replicas that all hold it is no flap either (switch_rate counts that). Requests that bypass the router
(the churn scenario's direct clients) are not counted at all: they are no routing decision
(docs/SIMULATOR.md, "flap_rate and traffic the router never sees").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from bench.sim.profiles import EngineProfile, prefill_time_s
from bench.sim.types import SimRequest

SWITCH_MIN_COVERAGE = 0.5  # a shared prefix counts if it covers >= 50% of the input
HOT_WINDOW_S = 60.0  # ... and was asked for within this long before (the article's stickiness bound T)


class HotPrefixes:
    """Replays requests in order and tells, for each, its hot key (see module docstring)."""

    def __init__(self, window_s: float = HOT_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: set[int] = set()
        self._last: dict[int, tuple[str, float]] = {}  # block id -> (worker, arrival) of its latest request

    def hot_key(self, req: SimRequest) -> tuple[int, str] | None:
        """(key depth, worker of the latest earlier request with the key) if `req` has a hot prefix."""
        depth = -1
        for i, block_id in enumerate(req.block_ids):
            if block_id in self._seen:
                depth = i
        if depth < 0:
            return None
        previous = self._last.get(req.block_ids[depth])
        if previous is None or req.arrival_s - previous[1] > self.window_s:
            return None
        if sum(req.block_tokens[: depth + 1]) < SWITCH_MIN_COVERAGE * req.input_tokens:
            return None
        return depth, previous[0]

    def record(self, req: SimRequest, worker: str | None) -> None:
        """`req` went to `worker` (None: rejected; its blocks count as seen, it routed nowhere)."""
        self._seen.update(req.block_ids)
        if worker is not None:
            for block_id in req.block_ids:
                self._last[block_id] = (worker, req.arrival_s)


class EngineTruth(Protocol):
    """What `FlapCounter` reads of the cluster at a routing instant (SimCluster provides it)."""

    def cached_prefix_blocks(self, worker_id: str, req: SimRequest) -> int: ...
    def queued_prefill_tokens(self, worker_id: str) -> int: ...


class FlapCounter:
    """Counts flap_rate's numerator and denominator as requests are dispatched (in dispatch order)."""

    def __init__(self, profile: EngineProfile, window_s: float = HOT_WINDOW_S) -> None:
        self.profile = profile
        self.hot = HotPrefixes(window_s)
        self.requests = 0  # hot-prefix requests
        self.flaps = 0

    def holder_free(self, req: SimRequest, depth: int, worker: str, cluster: EngineTruth) -> bool | None:
        """None if `worker` does not hold the prefix; else whether it is not overloaded for `req`."""
        hit_blocks = cluster.cached_prefix_blocks(worker, req)
        if hit_blocks <= depth:
            return None
        hit = sum(req.block_tokens[:hit_blocks])
        saves = prefill_time_s(self.profile, req.input_tokens, 0) - prefill_time_s(
            self.profile, max(1, req.input_tokens - hit), hit
        )
        return prefill_time_s(self.profile, cluster.queued_prefill_tokens(worker), 0) <= saves

    def observe(self, req: SimRequest, chosen: str, workers: Sequence[str], cluster: EngineTruth) -> None:
        """Call before `req` is submitted to `chosen`."""
        key = self.hot.hot_key(req)
        if key is not None:
            depth = key[0]
            self.requests += 1
            if self.holder_free(req, depth, chosen, cluster) is None and any(
                self.holder_free(req, depth, w, cluster) for w in workers if w != chosen
            ):
                self.flaps += 1
        self.hot.record(req, chosen)

    def bypass(self, req: SimRequest, worker: str) -> None:
        """`req` reached `worker` without the router (churn's direct clients): it is no routing decision,
        so it is neither a hot-prefix request nor a flap; its prefix still counts as asked for."""
        self.hot.record(req, worker)

    def reject(self, req: SimRequest) -> None:
        self.hot.record(req, None)

    @property
    def rate(self) -> float:
        return self.flaps / self.requests if self.requests else 0.0
