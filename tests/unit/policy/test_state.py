"""policy/state.py: prepare fills hits, sticky worker and rate; commit records the routing."""

from __future__ import annotations

import math

import pytest

from policy.config import ReplicaConfig, RoutingConfig
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


def _rate(state: RoutingState, now_s: float) -> float:
    view = state.prepare(
        request_id="r", prefix_hashes=[1], block_tokens=[100], prompt_tokens=100, workers=WORKERS, now_s=now_s
    )
    return view.prefix_rate


def test_young_prefix_rate_reads_its_arrivals_since_the_first_without_warm_up() -> None:
    plain, young = make_state(), make_state(rate_young_window_s=2.0)
    for state in (plain, young):
        for i in range(5):
            route(state, [1], [100], "a", now_s=i * 0.25)  # 4 req/s for 1 s
    # the plain EWMA from 0 still reads 5 × ln 2 / 30 s (0.12 req/s: not hot); the young rate counts
    # the 4 requests after the first over the 2 s window
    assert math.isclose(_rate(plain, 1.0), 5 * math.log(2) / 30, rel_tol=0.05)
    assert math.isclose(_rate(young, 1.0), 2.0, rel_tol=0.02)
    assert _rate(young, 2.5) == _rate(plain, 2.5)  # past the window: the plain EWMA


def test_young_prefix_rate_is_the_plain_ewma_after_one_request_and_when_old() -> None:
    plain, young = make_state(), make_state(rate_young_window_s=2.0)
    for state in (plain, young):
        route(state, [1], [100], "a", now_s=0.0)
    assert _rate(young, 0.1) == _rate(plain, 0.1)  # one request: no evidence of a rate yet
    for state in (plain, young):
        for i in range(1, 400):
            route(state, [1], [100], "a", now_s=i * 0.5)  # 2 req/s for 200 s (≈ 7 half-lives)
    assert _rate(young, 200.0) == _rate(plain, 200.0)
    assert math.isclose(_rate(young, 200.0), 2.0, rel_tol=0.05)


def test_young_rate_needs_more_than_one_conversations_next_turn() -> None:
    # an agent's tool loop: a turn every 0.7 s, each extending the last inside its final block, so the
    # turns share every full block. Its next turn is one request after the first: one gap, not a rate
    # of many requests arriving together; with the 2 s window it would read 1 / 2 s = 0.5 req/s (hot).
    one, two = (
        make_state(rate_young_window_s=2.0, rate_young_min_requests=1),
        make_state(rate_young_window_s=2.0),
    )
    plain = make_state()
    for state in (one, two, plain):
        route(state, [1], [100], "a", now_s=0.0)
        route(state, [1], [100], "a", now_s=0.7)
    assert math.isclose(_rate(one, 1.4), 0.5, rel_tol=0.02)  # min 1: the old reading, hot
    assert _rate(two, 1.4) == _rate(plain, 1.4) < 0.1  # the default (2): the plain EWMA
    for state in (one, two):
        route(state, [1], [100], "a", now_s=0.8)  # a third request in the window: two after the first
    assert math.isclose(_rate(two, 1.4), 1.0, rel_tol=0.03)
    assert _rate(two, 1.4) == _rate(one, 1.4)


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


def test_load_meter_reads_a_steady_rate_at_any_age_without_warm_up() -> None:
    from policy.state import LoadMeter

    meter = LoadMeter(half_life_s=30.0)
    assert meter.rate(0.0) == 0.0
    meter.add(0.5, 0.0)
    assert meter.rate(0.0) == 0.0  # one event starts the clock: no rate yet
    for i in range(1, 11):  # 0.5 engine-seconds every 0.1 s for 1 s: 5 s per s
        meter.add(0.5, i * 0.1)
    # at 1/30 of a half-life (an EWMA from 0 would read 0.11 × the rate); the last event counting whole
    # at `now` is the only (discretisation) error
    assert math.isclose(meter.rate(1.0), 5.0, rel_tol=0.01)
    for i in range(11, 3001):
        meter.add(0.5, i * 0.1)
    assert math.isclose(meter.rate(300.0), 5.0, rel_tol=0.01)
    assert math.isclose(meter.rate(330.0), 2.5, rel_tol=0.01)  # 30 s quiet: half
    meter.add(1.0, 320.0)  # an event stamped before the last one counts at the last time
    assert meter.rate(330.0) > 0.0


def test_cluster_load_is_the_routed_work_per_worker_of_the_pool() -> None:
    from policy.config import TtftModelConfig

    ttft = TtftModelConfig(
        prefill_tokens_per_s=1000.0,
        attention_s_per_token_ctx=0.0,
        decode_s_per_token=0.001,
        decode_s_per_token_ctx=0.0,
    )
    state = RoutingState(RoutingConfig(ttft=ttft, rate_half_life_s=30.0), PrefixIndex(1000))
    for i in range(101):  # every second: 500 uncached tokens (0.5 s) + 100 output tokens (0.1 s)
        view = state.prepare(
            request_id=str(i), prefix_hashes=[i], block_tokens=[500], prompt_tokens=500,
            max_tokens=100, workers=WORKERS, now_s=float(i),
        )  # fmt: skip
        state.commit(view, Decision(worker="a", reason="test"), float(i))
    view = state.prepare(
        request_id="n", prefix_hashes=[7], block_tokens=[500], prompt_tokens=500, workers=WORKERS, now_s=100.0
    )
    assert math.isclose(view.cluster_load, 0.6 / 2, rel_tol=0.02) and view.pool_workers == 2
    # a candidate sample of a larger pool: the load is shared by the whole pool
    sampled = state.prepare(
        request_id="n", prefix_hashes=[7], block_tokens=[500], prompt_tokens=500, workers=WORKERS,
        now_s=100.0, pool_workers=6,
    )  # fmt: skip
    assert math.isclose(sampled.cluster_load, 0.1, rel_tol=0.02) and sampled.pool_workers == 6
    # a cached prefix is not work: the same request again on its holder adds only its decode
    hit = state.prepare(
        request_id="h", prefix_hashes=[100], block_tokens=[500], prompt_tokens=500, max_tokens=100,
        workers=WORKERS, now_s=100.0,
    )  # fmt: skip
    assert hit.hit_tokens("a") == 500


def test_prepare_reads_the_prefix_age_and_the_cache_fill_only_when_priced() -> None:
    for when, fill in (("always", {}), ("priced", {"a": 0.0, "b": 0.003})):
        state = RoutingState(RoutingConfig(replicas=ReplicaConfig(proactive_when=when)), PrefixIndex(1000))
        route(state, [1, 2, 3], [100, 100, 50], "b", now_s=1.0)
        view = state.prepare(
            request_id="r2",
            prefix_hashes=[1, 2, 3],
            block_tokens=[100, 100, 50],
            prompt_tokens=250,
            workers=WORKERS,
            now_s=3.5,
        )
        assert view.prefix_age_s == pytest.approx(2.5)
        assert dict(view.cache_fill) == pytest.approx(fill)  # 3 of b's 1000 index blocks
