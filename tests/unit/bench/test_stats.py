"""The two percentile definitions of bench/stats.py: hand-worked cases and the properties that define them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.stats import nearest_rank_percentile, percentile

CASES = [
    # values, q, linear, nearest rank
    pytest.param([1.0, 2.0, 3.0, 4.0], 50, 2.5, 2.0, id="p50 of four: midpoint vs lower middle"),
    pytest.param([1.0, 2.0, 3.0, 4.0], 0, 1.0, 1.0, id="p0 is the minimum"),
    pytest.param([1.0, 2.0, 3.0, 4.0], 100, 4.0, 4.0, id="p100 is the maximum"),
    pytest.param([0.0, 10.0], 90, 9.0, 10.0, id="p90 of two"),
    pytest.param(
        [float(v) for v in range(1, 21)], 99, 19.81, 20.0, id="p99 of twenty: nearest rank is the max"
    ),
    pytest.param([7.0], 37, 7.0, 7.0, id="one value"),
]


@pytest.mark.parametrize(("values", "q", "linear", "nearest"), CASES)
def test_hand_worked_percentiles(values: list[float], q: float, linear: float, nearest: float) -> None:
    assert percentile(values, q) == pytest.approx(linear)
    assert nearest_rank_percentile(list(reversed(values)), q) == nearest  # any order


def test_no_values_give_nan() -> None:
    assert math.isnan(percentile([], 50))
    assert math.isnan(nearest_rank_percentile([], 50))


# integer-valued: differences are exact, so rounding cannot step outside a segment
values_st = st.lists(st.integers(-(10**6), 10**6).map(float), min_size=1, max_size=50)
q_st = st.floats(0, 100)


@given(values=values_st, q=q_st)
def test_nearest_rank_is_the_smallest_value_with_q_percent_at_or_below(values: list[float], q: float) -> None:
    p = nearest_rank_percentile(values, q)
    assert p in values
    assert sum(v <= p for v in values) >= q / 100 * len(values)
    assert sum(v < p for v in values) < max(1.0, q / 100 * len(values))


@given(values=values_st, q1=q_st, q2=q_st)
def test_linear_stays_in_range_and_grows_with_q(values: list[float], q1: float, q2: float) -> None:
    ordered = sorted(values)
    lo, hi = sorted((q1, q2))
    assert ordered[0] <= percentile(ordered, lo) <= percentile(ordered, hi) <= ordered[-1]
