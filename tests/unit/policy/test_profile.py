"""policy/pickers.py and policy/profile.py: tie-breaks, weights, rejections, decision records."""

from __future__ import annotations

import random

import pytest

from policy.filters import Eligible
from policy.pickers import MaxScore, MinCost
from policy.profile import Profile
from policy.scorers import Load, PrefixMatch
from policy.types import RequestView, WorkerView


@pytest.mark.parametrize(
    ("picker", "totals", "allowed"),
    [
        pytest.param(MaxScore(), {"a": 0.1, "b": 0.9}, {"b"}, id="max-score: highest"),
        pytest.param(MinCost(), {"a": 0.1, "b": 0.9}, {"a"}, id="min-cost: lowest"),
        pytest.param(MaxScore(), {"a": 1.0, "b": 1.0, "c": 0.0}, {"a", "b"}, id="max-score: ties among best"),
    ],
)
def test_pickers(picker: MaxScore | MinCost, totals: dict[str, float], allowed: set[str]) -> None:
    assert picker.pick(totals, random.Random(0)) in allowed


def test_tie_break_is_seeded_and_covers_all_ties() -> None:
    totals = {w: 1.0 for w in "abcd"}
    picks = [MaxScore().pick(totals, random.Random(seed)) for seed in range(40)]
    assert set(picks) == set("abcd")
    assert picks == [MaxScore().pick(dict(reversed(totals.items())), random.Random(s)) for s in range(40)]


def test_empty_totals_raise() -> None:
    with pytest.raises(ValueError):
        MinCost().pick({}, random.Random(0))


REQ = RequestView(id="r", prefix_hashes=(1,), block_tokens=(100,), prompt_tokens=100, prefix_hits={"b": 1})
WORKERS = [WorkerView(id="a", inflight=0), WorkerView(id="b", inflight=16)]


@pytest.mark.parametrize(
    ("weights", "winner"),
    [
        pytest.param((1.0, 0.0), "a", id="load only: idle worker"),
        pytest.param((0.0, 1.0), "b", id="prefix only: cached worker"),
        pytest.param((1.0, 1.0), "b", id="prefix 1 beats load 0.5"),
        pytest.param((3.0, 1.0), "a", id="heavy load weight"),
    ],
)
def test_profile_weights(weights: tuple[float, float], winner: str) -> None:
    profile = Profile(
        "t", [Eligible()], [(Load(saturate_at=32), weights[0]), (PrefixMatch(), weights[1])], MaxScore()
    )
    decision = profile.decide(REQ, WORKERS, random.Random(0), 0.0)
    assert decision.worker == winner
    assert set(decision.scores) == {"a", "b"}
    assert decision.scores[winner]["total"] == pytest.approx(
        weights[0] * decision.scores[winner]["load"] + weights[1] * decision.scores[winner]["prefix-match"]
    )
    assert "max-score" in decision.reason


def test_profile_rejects_naming_the_filter() -> None:
    profile = Profile("t", [Eligible()], [(Load(), 1.0)], MaxScore())
    decision = profile.decide(REQ, [WorkerView(id="a", draining=True)], random.Random(0), 0.0)
    assert decision.worker is None and "eligible" in decision.reason


@pytest.mark.parametrize(
    "scorers",
    [
        pytest.param([(Load(), -1.0)], id="negative weight"),
        pytest.param([(Load(), 1.0), (Load(), 1.0)], id="duplicate scorer"),
    ],
)
def test_profile_validation(scorers: list[tuple[Load, float]]) -> None:
    with pytest.raises(ValueError):
        Profile("t", [], scorers, MaxScore())
