"""A routing profile: filters → weighted scorers → picker (llm-d's scheduler profile, STYLE §7.2).

    candidates = eligible workers, narrowed by each filter in order (empty ⇒ reject, naming the filter)
    total(w)   = Σ weight_s × clamp01(score_s(w))         weights ≥ 0, belong to the profile
    winner     = picker(total)                             seeded tie-break

`decide()` has no side effects, so the simulator and the gateway call it unchanged. `Decision.scores`
carries every candidate's parts plus `total`, for the decision log.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from policy.filters import Filter
from policy.pickers import Picker
from policy.scorers import Scorer, clamp01
from policy.types import Decision, ReasonKind, RequestView, WorkerView


class RoutingPolicy(Protocol):
    """What the simulator adapter and the gateway call."""

    @property
    def name(self) -> str: ...

    def decide(
        self, req: RequestView, workers: Sequence[WorkerView], rng: random.Random, now_s: float
    ) -> Decision: ...


def run_filters(
    filters: Sequence[Filter], req: RequestView, workers: Sequence[WorkerView], now_s: float
) -> tuple[list[WorkerView], list[str], str | None]:
    """Apply filters in order; returns (candidates, names of filters that narrowed, name that emptied)."""
    current = list(workers)
    narrowed: list[str] = []
    for f in filters:
        after = f.filter(req, current, now_s)
        if not after:
            return [], narrowed, f.name
        if len(after) < len(current):
            narrowed.append(f.name)
        current = after
    return current, narrowed, None


def format_parts(parts: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in parts.items())


@dataclass(frozen=True)
class Profile:
    """A max-score policy assembled from parts; a scorer needs a weight ≥ 0."""

    name: str
    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker

    def __post_init__(self) -> None:
        names = [s.name for s, _ in self.scorers]
        if len(set(names)) != len(names):
            raise ValueError(f"profile {self.name}: duplicate scorer names in {names}")
        for s, weight in self.scorers:
            if weight < 0:
                raise ValueError(f"profile {self.name}: scorer {s.name} has weight {weight} < 0")

    def decide(
        self, req: RequestView, workers: Sequence[WorkerView], rng: random.Random, now_s: float
    ) -> Decision:
        candidates, narrowed, emptied = run_filters(self.filters, req, workers, now_s)
        if emptied is not None:
            return Decision.reject(f"no worker left after {emptied}")
        parts = {s.name: s.score(req, candidates, now_s) for s, _ in self.scorers}
        scores: dict[str, dict[str, float]] = {}
        totals: dict[str, float] = {}
        for w in candidates:
            row = {name: clamp01(parts[name][w.id]) for name in parts}
            totals[w.id] = sum(weight * row[s.name] for s, weight in self.scorers)
            row["total"] = totals[w.id]
            scores[w.id] = row
        winner = self.picker.pick(totals, rng)
        via = f" after {', '.join(narrowed)}" if narrowed else ""
        reason = f"{self.picker.name}{via}: {format_parts(scores[winner])}"
        return Decision(winner, reason, scores, kind=profile_kind(scores[winner], narrowed))


def profile_kind(parts: Mapping[str, float], narrowed: Sequence[str]) -> ReasonKind:
    """A profile decision's reason class: held by the stickiness filter, a prefix hit, or load."""
    if "sticky-hold" in narrowed:
        return ReasonKind.STICKINESS
    return ReasonKind.CACHE_HIT if parts.get("prefix-match", 0.0) > 0 else ReasonKind.LOAD
