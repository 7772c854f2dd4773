"""policy/state.py: prepare fills hits, sticky worker and rate; commit records the routing."""

from __future__ import annotations

import math

import pytest

from policy.config import RoutingConfig
from policy.index import PrefixIndex
from policy.state import RoutingState
from policy.types import Decision, WorkerView

WORKERS = [WorkerView(id="a"), WorkerView(id="b")]


def make_state(**config: object) -> RoutingState:
    return RoutingState(RoutingConfig(**config), PrefixIndex(1000))  # type: ignore[arg-type]


def route(state: RoutingState, hashes: list[int], tokens: list[int], worker: str, now_s: float) -> None:
    view = state.prepare(
        request_id="r",
        prefix_hashes=hashes,
        block_tokens=tokens,
        prompt_tokens=sum(tokens),
        workers=WORKERS,
        now_s=now_s,
    )
    state.commit(view, Decision(worker=worker, reason="test"), now_s)


def test_prepare_on_empty_state() -> None:
    view = make_state().prepare(
        request_id="r",
        prefix_hashes=[1, 2],
        block_tokens=[10, 5],
        prompt_tokens=15,
        workers=WORKERS,
        now_s=0.0,
    )
    assert (dict(view.prefix_hits), view.sticky_worker, view.prefix_rate) == ({}, None, 0.0)


def test_commit_inserts_and_next_request_sees_hits_and_sticky_worker() -> None:
    state = make_state()
    route(state, [1, 2, 3], [100, 100, 50], "b", now_s=1.0)
    view = state.prepare(
        request_id="r2",
        prefix_hashes=[1, 2, 4],
        block_tokens=[100, 100, 20],
        prompt_tokens=220,
        workers=WORKERS,
        now_s=2.0,
    )
    assert dict(view.prefix_hits) == {"b": 2}
    assert (view.sticky_worker, view.sticky_since_s) == ("b", 1.0)
    assert view.hit_tokens("b") == 200


@pytest.mark.parametrize(
    ("shared_tokens", "sticky"),
    [
        pytest.param(20, None, id="shared prefix below min gain carries no stickiness"),
        pytest.param(40, "a", id="shared prefix above min gain is sticky"),
    ],
)
def test_sticky_needs_min_gain_coverage(shared_tokens: int, sticky: str | None) -> None:
    state = make_state(min_cache_gain=0.3)
    route(state, [1, 2], [shared_tokens, 50], "a", now_s=0.0)
    view = state.prepare(
        request_id="r",
        prefix_hashes=[1, 9],
        block_tokens=[shared_tokens, 100 - shared_tokens],
        prompt_tokens=100,
        workers=WORKERS,
        now_s=1.0,
    )
    assert view.sticky_worker == sticky


def test_since_resets_when_prefix_moves() -> None:
    state = make_state()
    route(state, [1], [100], "a", now_s=0.0)
    route(state, [1], [100], "a", now_s=5.0)
    route(state, [1], [100], "b", now_s=7.0)
    stat = state.stats[1]
    assert (stat.worker, stat.since_s, stat.last_s) == ("b", 7.0, 7.0)


def test_rate_estimate_reads_the_steady_arrival_rate() -> None:
    state = make_state(rate_half_life_s=10.0)
    for i in range(400):
        route(state, [1], [100], "a", now_s=i * 0.5)  # 2 req/s
    view = state.prepare(
        request_id="r", prefix_hashes=[1], block_tokens=[100], prompt_tokens=100, workers=WORKERS, now_s=200.0
    )
    assert math.isclose(view.prefix_rate, 2.0, rel_tol=0.05)


def test_hits_only_for_candidate_workers_and_rejections_not_recorded() -> None:
    state = make_state()
    route(state, [1], [100], "gone", now_s=0.0)
    view = state.prepare(
        request_id="r", prefix_hashes=[1], block_tokens=[100], prompt_tokens=100, workers=WORKERS, now_s=1.0
    )
    assert dict(view.prefix_hits) == {}
    state.commit(view, Decision.reject("none"), 1.0)
    assert state.stats[1].last_s == 0.0


def test_stats_are_bounded() -> None:
    state = make_state(stats_max_entries=5)
    for i in range(20):
        route(state, [i], [10], "a", now_s=float(i))
    assert len(state.stats) == 5 and 19 in state.stats


def test_observe_workers_fills_join_time_and_forget_clears() -> None:
    state = make_state()
    first = state.observe_workers([WorkerView(id="a"), WorkerView(id="b", joined_s=3.0)], now_s=10.0)
    later = state.observe_workers([WorkerView(id="a")], now_s=20.0)
    assert [w.joined_s for w in first] == [10.0, 3.0] and later[0].joined_s == 10.0
    route(state, [1], [10], "a", 0.0)
    state.forget_worker("a")
    assert state.index.size("a") == 0 and "a" not in state.joined


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError):
        make_state().prepare(
            request_id="r", prefix_hashes=[1], block_tokens=[], prompt_tokens=1, workers=WORKERS, now_s=0.0
        )
