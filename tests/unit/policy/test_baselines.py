"""policy/baselines.py: the round-robin and least-loaded rules the gateway and the simulator share."""

from __future__ import annotations

import random

import pytest

from policy.baselines import least_loaded, round_robin


def test_round_robin_takes_the_workers_in_order_and_wraps() -> None:
    assert [round_robin(["a", "b", "c"], turn) for turn in range(5)] == ["a", "b", "c", "a", "b"]


def test_least_loaded_keeps_the_first_of_equal_loads_without_a_tie_break() -> None:
    load = {"a": 2, "b": 1, "c": 1}
    assert least_loaded(["a", "b", "c"], load.__getitem__) == "b"
    assert least_loaded(["c", "b", "a"], load.__getitem__) == "c"


def test_least_loaded_breaks_ties_by_the_key_it_is_given() -> None:
    load = {"a": 1, "b": 1, "c": 0.5}
    assert least_loaded(["a", "b", "c"], load.__getitem__, {"a": 0, "b": 1, "c": 9}.__getitem__) == "c"
    rng = random.Random(3)
    picks = {
        least_loaded(["a", "b"], {"a": 1, "b": 1}.__getitem__, lambda _: rng.random()) for _ in range(50)
    }
    assert picks == {"a", "b"}  # a seeded random tie-break spreads equal loads


@pytest.mark.parametrize("rule", [lambda: round_robin([], 0), lambda: least_loaded([], lambda w: 0)])
def test_no_workers_is_an_error(rule) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        rule()
