"""Pickers: choose one worker from per-worker totals; exact ties are broken by the injected RNG.

Candidates are considered in sorted id order before the random tie-break, so the same seed and the same
inputs always give the same choice (llm-d seeds its tie-break from the clock: STYLE §2 avoid-list).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


class Picker(Protocol):
    @property
    def name(self) -> str: ...

    def pick(self, totals: Mapping[str, float], rng: random.Random) -> str: ...


def _pick_best(totals: Mapping[str, float], rng: random.Random, *, highest: bool) -> str:
    if not totals:
        raise ValueError("no candidates to pick from")
    best = max(totals.values()) if highest else min(totals.values())
    ties = sorted(w for w, v in totals.items() if v == best)
    return ties[0] if len(ties) == 1 else rng.choice(ties)


@dataclass(frozen=True)
class MaxScore:
    """The worker with the highest total score; uniform random among exact ties."""

    name: str = "max-score"

    def pick(self, totals: Mapping[str, float], rng: random.Random) -> str:
        return _pick_best(totals, rng, highest=True)


@dataclass(frozen=True)
class MinCost:
    """The worker with the lowest total cost; uniform random among exact ties."""

    name: str = "min-cost"

    def pick(self, totals: Mapping[str, float], rng: random.Random) -> str:
        return _pick_best(totals, rng, highest=False)
