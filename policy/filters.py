"""Filters: each narrows the candidate workers for one reason; the profile stops when none are left.

Order matters and is the profile's: `Eligible` first (never route to draining or unhealthy workers),
then overload and affinity rules. Filters that express a preference rather than a hard rule
(`HardOverload`, `ImbalanceGuard`, `StickyHold`, `ReplicaCap`) never empty the set: when their rule
would remove everyone they return the input unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from policy.config import ReplicaConfig, StickyConfig
from policy.scorers import PredictedTtft, ServeCost, effective_hit_tokens, holding_costs_more, sticky_live
from policy.types import RequestView, WorkerView


class Filter(Protocol):
    @property
    def name(self) -> str: ...

    def filter(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> list[WorkerView]: ...


@dataclass(frozen=True)
class Eligible:
    """Keep healthy (lease valid), non-draining workers. May return an empty list (→ 503)."""

    name: str = "eligible"

    def filter(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> list[WorkerView]:
        return [w for w in workers if w.healthy and not w.draining]


@dataclass(frozen=True)
class HardOverload:
    """Drop workers at `inflight >= max_inflight_factor × max_concurrency` (when known, factor > 0) or
    `kv_usage >= max_kv_usage` (0–1]. Keeps everyone if everyone is overloaded (admission's job then)."""

    max_inflight_factor: float = 1.0
    max_kv_usage: float = 1.0
    name: str = "hard-overload"

    def overloaded(self, w: WorkerView) -> bool:
        full = w.max_concurrency > 0 and w.inflight >= self.max_inflight_factor * w.max_concurrency
        return full or w.kv_usage >= self.max_kv_usage

    def filter(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> list[WorkerView]:
        kept = [w for w in workers if not self.overloaded(w)]
        return kept or list(workers)


@dataclass(frozen=True)
class ImbalanceGuard:
    """SGLang router's imbalance rule on in-flight counts: when `max − min > abs_threshold` AND
    `max > rel_threshold × min`, keep only the least-loaded workers (defaults 64 / 1.5 as sglang-router
    0.3.2; abs ≥ 0, rel ≥ 1). Computed over the candidates, not over all workers (STYLE §3 avoid-list)."""

    abs_threshold: int = 64
    rel_threshold: float = 1.5
    name: str = "imbalance-guard"

    def filter(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> list[WorkerView]:
        if not workers:
            return []
        lo = min(w.inflight for w in workers)
        hi = max(w.inflight for w in workers)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            return [w for w in workers if w.inflight == lo]
        return list(workers)


@dataclass(frozen=True)
class StickyHold:
    """Within `window_s` after the request's leading prefix landed on its sticky worker, keep only that
    worker — unless it is not a candidate (gone, draining, unhealthy), or it is overloaded: with a `ttft`
    model, predicted TTFT above `overload_ttft_s` AND above `overload_ratio` × the best candidate's, or
    (with a `cost` model) above the cost of serving the request on any other candidate
    (`holding_costs_more`); without one, `inflight >= overload_inflight`. Hot prefixes (rate ≥
    `skip_rate_per_s`) are left to the replica cap instead (`inf` = never skip)."""

    ttft: PredictedTtft | None = None
    # window_s, overload_ttft_s and overload_ratio, with their defaults, are StickyConfig's
    config: StickyConfig = field(default_factory=StickyConfig)
    overload_inflight: int = 32
    skip_rate_per_s: float = float("inf")
    cost: ServeCost | None = None
    name: str = "sticky-hold"

    def filter(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> list[WorkerView]:
        if not sticky_live(req, now_s, self.config.window_s) or req.prefix_rate >= self.skip_rate_per_s:
            return list(workers)
        sticky = [w for w in workers if w.id == req.sticky_worker]
        if not sticky:
            return list(workers)
        if self.ttft is None:
            return list(workers) if sticky[0].inflight >= self.overload_inflight else sticky
        ttfts = self.ttft.ttfts(req, workers)
        mine, best = ttfts[sticky[0].id], min(ttfts.values())
        if mine > self.config.overload_ttft_s and mine > self.config.overload_ratio * best:
            return list(workers)
        others = [w for w in workers if w.id != sticky[0].id]
        if self.cost is not None and holding_costs_more(self.cost, req, sticky, others):
            return list(workers)
        return sticky


@dataclass(frozen=True)
class ReplicaCap:
    """Holders = candidates whose cached prefix counts (≥ min_gain of the prompt). Once `cap` (≥ 1) of
    them hold it, keep only the holders — unless the prefix is hot (rate ≥ hot_rate_per_s) and its
    holders are overloaded: the best holder's predicted TTFT ≥ overload_ttft_s, or the least-loaded
    holder has more than `overload_load_ratio` (≥ 1) × the least-loaded non-holder's in-flight
    requests + 1. Then a new replica may form. With a `cost` model, any prefix (hot or not) may also
    leave its holders when the best holder's predicted TTFT exceeds the cost of serving it on a
    non-holder (`holding_costs_more`)."""

    ttft: PredictedTtft
    config: ReplicaConfig  # cap, hot_rate_per_s, overload_ttft_s, overload_load_ratio
    cost: ServeCost | None = None
    name: str = "replica-cap"

    def filter(self, req: RequestView, workers: Sequence[WorkerView], now_s: float) -> list[WorkerView]:
        holders = [w for w in workers if effective_hit_tokens(req, w.id, self.ttft.min_gain) > 0]
        if len(holders) < self.config.cap:
            return list(workers)
        if self.cost is not None:
            non_holders = [w for w in workers if effective_hit_tokens(req, w.id, self.ttft.min_gain) <= 0]
            if holding_costs_more(self.cost, req, holders, non_holders):
                return list(workers)
        if req.prefix_rate >= self.config.hot_rate_per_s:
            best = min(self.ttft.ttfts(req, holders).values())
            others = [w.inflight for w in workers if effective_hit_tokens(req, w.id, self.ttft.min_gain) <= 0]
            least = min(w.inflight for w in holders)
            idle_other = min(others, default=least)
            if (
                best >= self.config.overload_ttft_s
                or least > self.config.overload_load_ratio * idle_other + 1
            ):
                return list(workers)
        return holders
