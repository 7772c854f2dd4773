"""policy/candidates.py: a small fleet is scored whole; a large one scores holders plus a bounded sample."""

from __future__ import annotations

import random

from policy.candidates import candidate_indices


def test_a_fleet_within_the_limit_is_scored_whole() -> None:
    assert candidate_indices(64, {3: 5}, limit=64, sample=16, rng=random.Random(1)) is None


def test_a_large_fleet_scores_every_holder_and_a_sample() -> None:
    holders = {7: 4, 900: 2, 501: 9}
    chosen = candidate_indices(1000, holders, limit=64, sample=16, rng=random.Random(1))
    assert chosen is not None and set(holders) <= set(chosen)
    assert len(chosen) == len(holders) + 16 and chosen == sorted(set(chosen))


def test_holders_beyond_the_limit_keep_the_longest_matches() -> None:
    holders = {i: (10 if i < 5 else 1) for i in range(200)}
    chosen = candidate_indices(1000, holders, limit=8, sample=4, rng=random.Random(2))
    assert chosen is not None and set(range(5)) <= set(chosen) and len(chosen) == 12
