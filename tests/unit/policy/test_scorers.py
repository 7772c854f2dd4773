"""policy/scorers.py: every scorer on a table of hand-made workers."""

from __future__ import annotations

import pytest

from policy.scorers import (
    ColdStart,
    KvFree,
    Load,
    PredictedTtft,
    PrefixMatch,
    QueueDepth,
    Scorer,
    Stickiness,
    TtftModel,
    effective_hit_tokens,
)
from policy.types import RequestView, WorkerView

REQ = RequestView(
    id="r",
    prefix_hashes=(1, 2, 3),
    block_tokens=(400, 400, 200),
    prompt_tokens=1000,
    prefix_hits={"a": 3, "b": 1},
    sticky_worker="b",
    sticky_since_s=100.0,
)
WORKERS = [
    WorkerView(id="a", inflight=0, waiting=0, kv_usage=0.2, joined_s=0.0),
    WorkerView(id="b", inflight=16, waiting=8, kv_usage=0.9, joined_s=90.0),
    WorkerView(id="c", inflight=40, waiting=50, kv_usage=1.0, joined_s=120.0),
]


@pytest.mark.parametrize(
    ("scorer", "expected"),
    [
        pytest.param(PrefixMatch(), {"a": 1.0, "b": 0.4, "c": 0.0}, id="prefix-match: hit share"),
        pytest.param(
            PrefixMatch(min_gain=0.5), {"a": 1.0, "b": 0.0, "c": 0.0}, id="prefix-match: below min gain"
        ),
        pytest.param(Load(saturate_at=32), {"a": 1.0, "b": 0.5, "c": 0.0}, id="load: linear to saturation"),
        pytest.param(QueueDepth(saturate_at=16), {"a": 1.0, "b": 0.5, "c": 0.0}, id="queue-depth"),
        pytest.param(KvFree(), {"a": 0.8, "b": 0.1, "c": 0.0}, id="kv-free"),
        pytest.param(Stickiness(window_s=30), {"a": 0.0, "b": 1.0, "c": 0.0}, id="stickiness: in window"),
        pytest.param(Stickiness(window_s=10), {"a": 0.0, "b": 0.0, "c": 0.0}, id="stickiness: window over"),
        pytest.param(
            ColdStart(period_s=60, discount=0.3), {"a": 0.0, "b": 0.15, "c": 0.3}, id="cold-start fades"
        ),
        pytest.param(
            ColdStart(period_s=0, discount=0.3), {"a": 0.0, "b": 0.0, "c": 0.0}, id="cold-start off"
        ),
    ],
)
def test_scorer_table(scorer: Scorer, expected: dict[str, float]) -> None:
    got = scorer.score(REQ, WORKERS, now_s=120.0)
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("worker", "uncached", "expected_s"),
    [
        pytest.param(WorkerView(id="idle"), 1000, 0.02 + 1000 / 10_000, id="idle: own prefill only"),
        pytest.param(
            WorkerView(id="q", pending_prefill_tokens=9000), 1000, 0.02 + 1.0, id="queued prefill adds"
        ),
        pytest.param(WorkerView(id="busy", inflight=50), 1000, 0.02 + 0.1 * 1.5, id="decodes slow prefill"),
        pytest.param(WorkerView(id="hit"), 0, 0.02, id="fully cached: overhead only"),
    ],
)
def test_ttft_model(worker: WorkerView, uncached: int, expected_s: float) -> None:
    model = TtftModel(10_000, decode_slowdown=0.01, overhead_s=0.02, attention_s_per_token_ctx=0.0)
    assert model.ttft_s(worker, uncached) == pytest.approx(expected_s)


@pytest.mark.parametrize(
    ("uncached", "hit", "expected_s"),
    [
        pytest.param(1000, 0, 1000 * 1000 / 2 * 1e-9, id="attention over own tokens"),
        pytest.param(1000, 4000, 1000 * (4000 + 500) * 1e-9, id="attention over cached context too"),
    ],
)
def test_attention_term(uncached: int, hit: int, expected_s: float) -> None:
    model = TtftModel(1e12, decode_slowdown=0.0, overhead_s=0.0, attention_s_per_token_ctx=1e-9)
    assert model.ttft_s(WorkerView(id="w"), uncached, hit) == pytest.approx(expected_s, rel=1e-3)


def test_predicted_ttft_uses_effective_hits_and_scores_in_unit_interval() -> None:
    scorer = PredictedTtft(
        TtftModel(1000, decode_slowdown=0.0, overhead_s=0.0, attention_s_per_token_ctx=0.0), min_gain=0.5
    )
    ttfts = scorer.ttfts(REQ, WORKERS)
    assert ttfts == pytest.approx({"a": 0.0, "b": 1.0, "c": 1.0})  # b's 40 % hit is below min gain
    assert scorer.score(REQ, WORKERS, 0.0) == pytest.approx({"a": 1.0, "b": 0.5, "c": 0.5})


@pytest.mark.parametrize(
    ("worker", "min_gain", "expected"),
    [
        pytest.param("a", 0.3, 1000, id="full hit"),
        pytest.param("b", 0.3, 400, id="hit above gain"),
        pytest.param("b", 0.5, 0, id="hit below gain ignored"),
        pytest.param("c", 0.0, 0, id="no hit"),
    ],
)
def test_effective_hit_tokens(worker: str, min_gain: float, expected: int) -> None:
    assert effective_hit_tokens(REQ, worker, min_gain) == expected


def test_prefix_match_empty_prompt_scores_zero() -> None:
    assert PrefixMatch().score(RequestView(id="r"), WORKERS, 0.0) == {"a": 0.0, "b": 0.0, "c": 0.0}


def test_busy_weight_counts_the_least_loaded_workers_queue_in_full_prefills() -> None:
    from policy.scorers import PredictedTtft, ServeCost, TtftModel
    from policy.types import RequestView, WorkerView

    cost = ServeCost(PredictedTtft(TtftModel(1000.0, 0.0, 0.0, 0.0)), busy_weight_max=4.0)
    r = RequestView(id="r", prompt_tokens=2000)
    busy = [WorkerView(id="a", pending_prefill_tokens=6000), WorkerView(id="b", pending_prefill_tokens=3000)]
    assert cost.busy_weight(r, busy) == 1.5  # b: 3 s queued ÷ 2 s prefill
    assert cost.busy_weight(r, [*busy, WorkerView(id="c")]) == 0.0  # an idle worker: no pressure
    flooded = [WorkerView(id="a", pending_prefill_tokens=60_000)]
    assert cost.busy_weight(r, flooded) == 4.0  # capped
    assert ServeCost(cost.ttft).busy_weight(r, busy) == 0.0  # off by default


@pytest.mark.parametrize(
    ("servers", "rho", "expected"),
    [
        pytest.param(1, 0.3, 0.3, id="M/M/1: an arrival waits with probability rho"),
        pytest.param(2, 0.5, 1 / 3, id="M/M/2 at a = 1: 1/3"),
        pytest.param(8, 0.0, 0.0, id="idle"),
        pytest.param(8, 1.0, 1.0, id="saturated"),
        pytest.param(8, 1.7, 1.0, id="overloaded"),
    ],
)
def test_erlang_c(servers: int, rho: float, expected: float) -> None:
    from policy.scorers import erlang_c

    assert erlang_c(servers, rho) == pytest.approx(expected)


def test_erlang_c_grows_with_load_and_falls_with_pooling() -> None:
    from policy.scorers import erlang_c

    loads = [erlang_c(8, r / 10) for r in range(10)]
    assert loads == sorted(loads) and loads[0] == 0.0
    assert erlang_c(16, 0.8) < erlang_c(8, 0.8) < erlang_c(1, 0.8)


@pytest.mark.parametrize(
    ("mode", "rho", "pool", "expected"),
    [
        pytest.param("fixed", 0.0, 8, 1.0, id="fixed: the load is not read"),
        pytest.param("queueing", 0.5, 2, 1 / 3, id="queueing: Erlang C"),
        pytest.param("queueing", 0.2, 16, 0.0, id="queueing: a large idle pool displaces nobody"),
        pytest.param("queueing", 1.2, 16, 1.0, id="queueing: overload, every recompute displaces"),
    ],
)
def test_miss_weight_is_scaled_by_what_a_recompute_displaces(
    mode: str, rho: float, pool: int, expected: float
) -> None:
    from policy.scorers import ServeCost

    cost = ServeCost(PredictedTtft(TtftModel(1000.0, 0.0, 0.0, 0.0)), miss_weight=1.0, miss_load=mode)
    r = RequestView(id="r", prompt_tokens=2000, cluster_load=rho, pool_workers=pool)
    assert cost.displaced(r) == pytest.approx(expected, abs=1e-6)
    ttft, miss, total = cost.parts(r, WorkerView(id="a"), 0)
    assert (ttft, miss) == (2.0, 2.0) and total == pytest.approx(2.0 + 2.0 * expected, abs=1e-5)


def test_work_counts_uncached_prefill_and_decode_with_its_kv_read() -> None:
    model = TtftModel(1000.0, 0.0, 0.0, 0.0, decode_s_per_token=0.001, decode_s_per_token_ctx=1e-6)
    # 500 uncached: 0.5 s; 100 out at mean context 1000 + 500 + 50: 100 × (0.001 + 0.00155)
    assert model.work_s(500, 1000, 100) == pytest.approx(0.5 + 0.255)
    assert model.work_s(0, 1000, 0) == 0.0  # a full hit with nothing to decode costs nothing
