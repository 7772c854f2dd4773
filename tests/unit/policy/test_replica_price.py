"""policy/replica_price.py: what a proactive replica brings against what it costs, by hand."""

from __future__ import annotations

import math

import pytest

from policy.replica_price import copy_benefit_s, evicted_tokens, in_system, unbiased_rate

HALF_LIFE = 30.0
STEP = math.log(2) / HALF_LIFE


def ewma_of(rate: float, age_s: float) -> float:
    """The prefix EWMA (policy/state.py: each request adds ln 2 ÷ h) of a steady stream at `age_s`."""
    n = round(rate * age_s)
    return sum(STEP * 0.5 ** ((age_s - i / rate) / HALF_LIFE) for i in range(n + 1))


@pytest.mark.parametrize("age_s", [1.0, 5.0, 30.0, 120.0])
def test_unbiased_rate_reads_a_steady_stream_at_any_age(age_s: float) -> None:
    # the plain EWMA reads 10 req/s as 10 x ln 2 / 30 x age at first: 2.3 req/s after 1 s
    ewma = ewma_of(10.0, age_s)
    assert unbiased_rate(ewma, age_s, HALF_LIFE) == pytest.approx(10.0, rel=0.05)
    if age_s <= 5.0:
        assert ewma < 10.0 * 0.6


def test_unbiased_rate_without_an_age_is_the_ewma() -> None:
    assert unbiased_rate(0.4, 0.0, HALF_LIFE) == 0.4
    assert unbiased_rate(0.4, 1e6, HALF_LIFE) == pytest.approx(0.4)


def test_in_system_is_infinite_once_the_holders_cannot_carry_it() -> None:
    assert in_system(0.5) == pytest.approx(1.0)
    assert math.isinf(in_system(1.0)) and math.isinf(in_system(3.0))


def test_a_copy_of_a_prefix_its_holders_cannot_carry_is_worth_any_cost() -> None:
    # 10 req/s x 0.15 s of engine work = 1.5 engine-s/s on one holder: it cannot keep up
    assert math.isinf(copy_benefit_s(10.0, 0.15, 0.01, 1, 30.0, 0.0))
    # on two holders 0.75 each, a third brings them to 0.5: finite, T x p/s x (2 x 3 - 3 x 1) = 30 x 1/15 x 3
    assert copy_benefit_s(10.0, 0.15, 0.01, 2, 30.0, 0.0) == pytest.approx(6.0)


def test_a_copy_of_a_lightly_used_prefix_saves_little_and_nothing_without_a_future() -> None:
    # 0.5 req/s x 0.1 s = 0.05: 1 x L(0.05) - 2 x L(0.025) = 0.00135; x 30 s x 0.2 (prefill share) = 0.0081
    assert copy_benefit_s(0.5, 0.1, 0.02, 1, 30.0, 0.0) == pytest.approx(0.0081, abs=1e-4)
    assert copy_benefit_s(0.5, 0.1, 0.02, 1, 0.0, 0.0) == 0.0
    # a 1 s backlog on the holders: the requests of the next second gain 0.5 s on average
    assert copy_benefit_s(0.5, 0.1, 0.02, 1, 0.0, 1.0) == pytest.approx(0.25)


def test_evicted_tokens_are_what_does_not_fit_in_the_free_kv() -> None:
    assert evicted_tokens(2000, 0.5, 10_000) == 0
    assert evicted_tokens(2000, 0.9, 10_000) == 1000
    assert evicted_tokens(2000, 1.0, 10_000) == 2000
    assert evicted_tokens(2000, 1.0, 0) == 0  # capacity unknown
