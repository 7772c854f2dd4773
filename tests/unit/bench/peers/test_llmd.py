"""llm-d EPP: stale-pod filter, min-max queue score, 1 - kv, approximate / precise prefix, weights."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.peers.llmd import LlmdRouter, index_blocks, make_approx_router, make_precise_router
from bench.sim.types import Scraped
from tests.unit.bench.peers.fake_cluster import FakeCluster, request

PODS = ["p0", "p1", "p2"]


def scrapes(waiting: list[int], kv: list[float], at_s: float = 10.0) -> dict[str, Scraped]:
    return {
        p: Scraped(at_s=at_s, running=0, waiting=q, kv_usage=k)
        for p, q, k in zip(PODS, waiting, kv, strict=True)
    }


def test_config_rejects_negative_or_missing_weights() -> None:
    with pytest.raises(ValueError, match="weights"):
        LlmdRouter(
            "x", precise=False, weights={"queue": 1.0, "kv": -1.0, "prefix": 1.0}, rng=random.Random(0)
        )


@pytest.mark.parametrize(
    ("req", "expect"),
    [
        pytest.param(request([1], last_tokens=17), [(1, 2)], id="17 tokens = 68 chars: one block + tail"),
        pytest.param(request([1], last_tokens=16), [(1, 1)], id="16 tokens = 64 chars: one block, no tail"),
        pytest.param(request([1], last_tokens=15), [], id="60 chars < 64: no hashes"),
        pytest.param(
            request([1, 2], last_tokens=20), [(1, 32), (2, 2)], id="full block 32 + 16-token + tail"
        ),
        pytest.param(
            request(list(range(10))), [(i, 32) for i in range(8)], id="cap 256 blocks = 8 trace blocks"
        ),
    ],
)
def test_index_blocks_map_trace_blocks_to_64_char_blocks(req: object, expect: list[tuple[int, int]]) -> None:
    assert index_blocks(req) == expect  # type: ignore[arg-type]


def test_queue_score_is_min_max_and_kv_score_absolute() -> None:
    router = make_approx_router(0)
    cluster = FakeCluster(PODS, scraped_by=scrapes([2, 6, 10], [0.5, 0.0, 0.25]))
    router.route(request([1]), cluster, 10.0)
    assert {p: s["queue"] for p, s in router.last_scores.items()} == {"p0": 1.0, "p1": 0.5, "p2": 0.0}
    assert {p: s["kv"] for p, s in router.last_scores.items()} == {"p0": 0.5, "p1": 1.0, "p2": 0.75}


def test_equal_queues_all_score_one() -> None:
    router = make_approx_router(0)
    router.route(request([1]), FakeCluster(PODS, scraped_by=scrapes([4, 4, 4], [0, 0, 0])), 10.0)
    assert {s["queue"] for s in router.last_scores.values()} == {1.0}


def test_weights_decide_between_prefix_and_load() -> None:
    # p1 holds the whole prompt (prefix 1.0) but has the longest queue (0.0) and kv 0.5:
    #   p1 = 2*0 + 2*0.5 + 3*1 = 4.0 ; p0 = 2*1 + 2*0.9 + 0 = 3.8 ; p2 = 2*0.5 + 2*1 + 0 = 3.0 -> p1
    router = make_approx_router(0)
    router.index.insert(index_blocks(request([1, 2])), "p1", 10_000)
    cluster = FakeCluster(PODS, scraped_by=scrapes([0, 8, 4], [0.1, 0.5, 0.0]))
    assert router.route(request([1, 2]), cluster, 10.0) == "p1"
    # same state but prefix weight 1: p1 = 0 + 1 + 1 = 2.0 ; p0 = 2 + 1.8 = 3.8 -> p0
    light = LlmdRouter("x", precise=False, weights={"queue": 2, "kv": 2, "prefix": 1}, rng=random.Random(0))
    light.index.insert(index_blocks(request([1, 2])), "p1", 10_000)
    assert light.route(request([1, 2]), cluster, 10.0) == "p0"


def test_approximate_match_stops_at_first_block_no_pod_holds() -> None:
    router = make_approx_router(0)
    router.index.insert(index_blocks(request([1, 2])), "p0", 10_000)
    router.index.insert(index_blocks(request([1])), "p1", 10_000)
    cluster = FakeCluster(PODS, scraped_by=scrapes([0, 0, 0], [0, 0, 0]))
    router.route(request([1, 2, 3, 4]), cluster, 10.0)
    assert {p: s["prefix"] for p, s in router.last_scores.items()} == {"p0": 0.5, "p1": 0.25, "p2": 0.0}


def test_routed_prompt_enters_the_index_and_lru_evicts_oldest() -> None:
    router = make_approx_router(0)
    cluster = FakeCluster(PODS, scraped_by=scrapes([0, 5, 5], [0, 0, 0]), capacity=64 * 16)  # 64 blocks
    assert router.route(request([1, 2]), cluster, 10.0) == "p0"
    assert router.index.holds("p0", 1) and router.index.holds("p0", 2)
    router.route(request([3]), cluster, 10.0)  # 32 more blocks: 96 > 64, block 1 is the oldest
    assert not router.index.holds("p0", 1) and router.index.holds("p0", 3)


def test_stale_pods_are_filtered_unless_all_are_stale() -> None:
    router = make_approx_router(0)
    fresh_busy = Scraped(at_s=10.0, running=9, waiting=9, kv_usage=0.9)
    stale_idle = Scraped(at_s=9.7, running=0, waiting=0, kv_usage=0.0)
    cluster = FakeCluster(PODS, scraped_by={"p0": stale_idle, "p1": fresh_busy, "p2": stale_idle})
    assert router.route(request([1]), cluster, 10.0) == "p1"
    assert router.route(request([1]), cluster, 20.0) in {"p0", "p2"}  # all stale: fail open


def test_ties_are_broken_at_random_with_the_seed() -> None:
    cluster = FakeCluster(PODS, scraped_by=scrapes([0, 0, 0], [0, 0, 0]))
    picks = [make_approx_router(s).route(request([100 + s]), cluster, 10.0) for s in range(30)]
    assert set(picks) == set(PODS)
    again = [make_approx_router(s).route(request([100 + s]), cluster, 10.0) for s in range(30)]
    assert picks == again


def test_precise_prefix_is_longest_cached_prefix_over_total_64_token_blocks() -> None:
    router = make_precise_router(0)
    cluster = FakeCluster(
        PODS, scraped_by=scrapes([0, 0, 0], [0, 0, 0]), engine_blocks={"p1": {1, 2, 3}, "p2": {1, 3}}
    )
    # 4 x 512 tokens = 32 blocks of 64; p1 holds 3 trace blocks = 24, p2 only the first = 8
    assert router.route(request([1, 2, 3, 4]), cluster, 10.0) == "p1"
    assert {p: s["prefix"] for p, s in router.last_scores.items()} == {"p0": 0.0, "p1": 0.75, "p2": 0.25}


@given(
    waiting=st.lists(st.integers(0, 100), min_size=3, max_size=3),
    kv=st.lists(st.floats(0, 1), min_size=3, max_size=3),
)
def test_scores_stay_in_unit_interval(waiting: list[int], kv: list[float]) -> None:
    router = make_approx_router(0)
    router.route(request([1, 2]), FakeCluster(PODS, scraped_by=scrapes(waiting, kv)), 10.0)
    assert all(0.0 <= v <= 1.0 for s in router.last_scores.values() for v in s.values())
