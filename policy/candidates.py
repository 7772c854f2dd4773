"""Candidate sets: which workers a decision scores when the fleet is large.

Scoring every worker makes a decision O(workers): about 16 ms at 1,000 workers (`kvgate bench scale`).
Above `limit` workers a decision scores only a candidate set:

- the workers that hold the request's prefix, longest match first (at most `limit` of them; ties
  broken at random), since a hit is what the cost model values most and the sticky worker of a
  prefix is one of its holders (routing inserted the prefix there);
- `sample` other workers drawn at random, which is the power-of-k-choices rule for load: the least
  loaded of k random workers is nearly as good as the least loaded of all once k is a few.

A fleet of `limit` workers or fewer is scored whole, so its decisions are exactly those of the full
scan (the simulator's fleets and every test that pins a decision are below the limit).
"""

from __future__ import annotations

import random
from collections.abc import Mapping


def candidate_indices(
    n_workers: int,
    holder_hits: Mapping[int, int],
    *,
    limit: int,
    sample: int,
    rng: random.Random,
) -> list[int] | None:
    """Positions (into the fleet's worker list) to score, or None for all of them.

    `holder_hits` maps a holder's position to its matched blocks."""
    if n_workers <= limit:
        return None
    holders = sorted(holder_hits, key=lambda i: (-holder_hits[i], rng.random()))[:limit]
    chosen = set(holders)
    want = min(n_workers, len(chosen) + sample)
    while len(chosen) < want:  # sample << n_workers: a few draws, no O(n) pass
        chosen.add(rng.randrange(n_workers))
    return sorted(chosen)
