"""Metric definitions on hand-made runs: percentiles, utilization CV, and the hot-prefix switch rate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.sim.cluster import RequestRecord, SimResult
from bench.sim.load import decode_token_cost_s
from bench.sim.metrics import (
    METRIC_NAMES,
    coefficient_of_variation,
    compute_metrics,
    load_series,
    percentile,
    switch_stats,
)
from bench.sim.profiles import load_profile, prefill_time_s
from bench.sim.types import SimRequest

PROFILE = load_profile("h100-llama3.1-8b")


def req(i: int, ids: tuple[int, ...], tokens: tuple[int, ...] | None = None) -> SimRequest:
    tokens = tokens or (512,) * len(ids)
    return SimRequest(i, float(i), sum(tokens), 10, ids, tokens)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        pytest.param([1.0, 2.0, 3.0, 4.0], 50, 2.5, id="median interpolates"),
        pytest.param([1.0, 2.0, 3.0, 4.0], 100, 4.0, id="max"),
        pytest.param([1.0, 2.0, 3.0, 4.0], 0, 1.0, id="min"),
        pytest.param([5.0], 99, 5.0, id="single value"),
        pytest.param([0.0, 10.0], 90, 9.0, id="p90 of two"),
    ],
)
def test_percentile(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))


def test_coefficient_of_variation() -> None:
    assert coefficient_of_variation([0.5, 0.5, 0.5]) == 0.0
    assert coefficient_of_variation([0.2, 0.6]) == pytest.approx(0.2 / 0.4)
    assert coefficient_of_variation([0.0, 0.0]) == 0.0


SHARED = (1, 2, 3)  # a 3-block prefix shared by the requests below


@pytest.mark.parametrize(
    ("requests", "workers", "expected"),
    [
        pytest.param(
            [req(0, (*SHARED, 10)), req(1, (*SHARED, 11)), req(2, (*SHARED, 12))],
            ["a", "a", "a"],
            (0, 2),
            id="same worker twice: two pairs, no switch",
        ),
        pytest.param(
            [req(0, (*SHARED, 10)), req(1, (*SHARED, 11)), req(2, (*SHARED, 12))],
            ["a", "b", "b"],
            (1, 2),
            id="one move then stays",
        ),
        pytest.param(
            [req(0, (*SHARED, 10)), req(1, (1, 20, 21, 22))],
            ["a", "b"],
            (0, 0),
            id="shared prefix under half the input is not counted",
        ),
        pytest.param(
            [req(0, (*SHARED, 10)), req(1, (*SHARED, 11)), req(2, (*SHARED, 11, 30))],
            ["a", "b", "a"],
            (2, 2),
            id="deepest seen block is the key: compared with the request holding it",
        ),
        pytest.param(
            [req(0, (*SHARED, 10)), req(1, (*SHARED, 11)), req(2, (*SHARED, 12))],
            ["a", None, "a"],
            (0, 1),
            id="rejected requests neither count nor update",
        ),
        pytest.param(
            [req(0, (1,), (100,)), req(1, (2,), (100,))],
            ["a", "b"],
            (0, 0),
            id="nothing shared",
        ),
    ],
)
def test_switch_stats(
    requests: list[SimRequest], workers: list[str | None], expected: tuple[int, int]
) -> None:
    assert switch_stats(requests, workers) == expected


def test_switch_stats_counts_only_pairs_within_the_hot_window() -> None:
    early = req(0, (*SHARED, 10))
    late = SimRequest(1, 100.0, 4 * 512, 10, (*SHARED, 11), (512,) * 4)  # 100 s later: prefix gone cold
    assert switch_stats([early, late], ["a", "b"]) == (0, 0)
    assert switch_stats([early, late], ["a", "b"], window_s=math.inf) == (1, 1)
    assert switch_stats([early, late], ["a", "b"], window_s=100.0) == (1, 1)


def record(i: int, worker: str, arrival: float, first: float, finish: float, cached: int) -> RequestRecord:
    return RequestRecord(i, arrival, 1000, 10, 1, "default", worker, arrival, first, finish, cached)


def test_compute_metrics_on_a_hand_made_run() -> None:
    requests = [req(0, (1, 2), (512, 488)), req(1, (1, 2), (512, 488))]
    records = [record(0, "w0", 0.0, 0.5, 2.0, 0), record(1, "w1", 1.0, 1.1, 4.0, 512)]
    result = SimResult("x", records, ["w0", "w1"], {"w0": 1.0, "w1": 3.0}, {}, {}, duration_s=4.0)
    m = compute_metrics(result, requests, PROFILE)
    assert set(METRIC_NAMES) <= set(m)
    assert m["hit_rate"] == pytest.approx(512 / 2000)
    assert m["ttft_p50"] == pytest.approx(0.3)
    assert m["e2e_p99"] == pytest.approx(2.0 + 0.99 * 1.0)
    assert m["throughput_rps"] == pytest.approx(0.5)
    assert m["throughput_tok_s"] == pytest.approx(5.0)
    assert m["per_worker_busy"] == {"w0": 0.25, "w1": 0.75}
    decode_token = decode_token_cost_s(PROFILE, requests)
    useful = {  # uncached prefill after the cached context + 10 decode tokens each, over 4 s
        "w0": (prefill_time_s(PROFILE, 1000, 0) + 10 * decode_token) / 4.0,
        "w1": (prefill_time_s(PROFILE, 488, 512) + 10 * decode_token) / 4.0,
    }
    assert m["per_worker_util"] == pytest.approx(useful)
    assert m["util_cv"] == pytest.approx(coefficient_of_variation(list(useful.values())))
    assert m["switch_rate"] == 1.0
    assert m["inflight_cv"] == pytest.approx(coefficient_of_variation([2.0 / 4, 3.0 / 4]))
    assert m["prefill_tokens_cv"] == pytest.approx(coefficient_of_variation([1000, 488]))
    expected_queue = [
        0.5 - prefill_time_s(PROFILE, 1000, 0),
        max(0.0, 0.1 - prefill_time_s(PROFILE, 488, 512)),
    ]
    assert m["queue_p99"] == pytest.approx(percentile(sorted(expected_queue), 99))


def test_load_series_counts_in_flight_requests() -> None:
    records = [record(0, "w0", 0.0, 0.5, 2.0, 0), record(1, "w0", 1.0, 1.1, 4.0, 0)]
    series = load_series(records, ["w0", "w1"], samples=4)
    assert series.period_s == 1.0
    assert series.inflight == {"w0": [1, 2, 1, 1], "w1": [0, 0, 0, 0]}


@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 6), min_size=1, max_size=4), st.sampled_from("ab-")), max_size=30
    )
)
def test_switch_stats_stay_in_range(rows: list[tuple[list[int], str]]) -> None:
    requests = [req(i, tuple(ids)) for i, (ids, _) in enumerate(rows)]
    workers = [None if w == "-" else w for _, w in rows]
    switches, pairs = switch_stats(requests, workers)
    assert 0 <= switches <= pairs <= sum(w is not None for w in workers)
    assert switch_stats(requests, ["a" if w else None for w in workers])[0] == 0  # one worker never switches
