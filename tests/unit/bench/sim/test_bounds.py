"""Trace-only hit-rate bounds on hand-made traces and against the published values (PEERS.md §5)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.sim.bounds import (
    infinite_cache_hit_rate,
    pooled_lru_hit_rate,
    reusable_working_set_tokens,
    ttft_floor,
)
from bench.sim.profiles import load_profile, prefill_time_s
from bench.sim.traces import load_trace
from bench.sim.types import SimRequest

TRACES = Path("/work/shared/traces/mooncake_fast25")


def req(i: int, ids: tuple[int, ...], tokens: tuple[int, ...] | None = None) -> SimRequest:
    tokens = tokens or (100,) * len(ids)
    return SimRequest(i, float(i), sum(tokens), 1, ids, tokens)


HAND = [req(0, (1, 2)), req(1, (1, 2, 3)), req(2, (4,)), req(3, (1, 5))]


def test_infinite_cache_on_hand_trace() -> None:
    # hits: r1 blocks 1,2 (200 of 300); r3 block 1 (100 of 200); total input 100*8
    assert infinite_cache_hit_rate(HAND) == pytest.approx(300 / 800)


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [
        pytest.param(0, 0.0, id="no cache"),
        pytest.param(10, 300 / 800, id="large LRU equals infinite cache"),
        # capacity 3: after r1 LRU = [3,2,1] (1 most recent); r2 inserts 4, evicts 3 -> [2,1,4];
        # r3: block 1 hits; total 100
        pytest.param(3, 300 / 800, id="roots survive because touch is tail first"),
        # capacity 2: after r0 [2,1]; r1 hits 1,2, touches 3,2,1, evicts 3 -> [2,1]; r2 -> [1,4]; r3 hits 1
        pytest.param(2, 300 / 800, id="two blocks"),
        # capacity 1: after r0 [1]; r1 hits 1 only (2 evicted) -> [1]; r2 -> [4]; r3 misses
        pytest.param(1, 100 / 800, id="one block keeps only the root"),
    ],
)
def test_pooled_lru_on_hand_trace(capacity: int, expected: float) -> None:
    assert pooled_lru_hit_rate(HAND, capacity) == pytest.approx(expected)


def test_lru_counts_only_the_leading_run() -> None:
    # r1 makes 9 more recent than 8, r2 evicts 8: in r3 block 9 is cached but unusable without 8
    trace = [req(0, (8, 9)), req(1, (9,)), req(2, (7,)), req(3, (8, 9))]
    assert pooled_lru_hit_rate(trace, 2) == pytest.approx(100 / 600)


def test_reusable_working_set() -> None:
    assert reusable_working_set_tokens(HAND) == 200  # blocks 1 and 2 occur twice or more


@pytest.mark.skipif(not TRACES.exists(), reason="shared traces not mounted")
@pytest.mark.parametrize(
    ("name", "ideal", "lru"),
    [
        pytest.param(
            "conversation_trace", 0.374, {1000: 0.045, 10000: 0.216, 50000: 0.362}, id="conversation"
        ),
        pytest.param("synthetic_trace", 0.651, {1000: 0.086, 10000: 0.432, 50000: 0.651}, id="synthetic"),
    ],
)
def test_real_traces_match_published_bounds(name: str, ideal: float, lru: dict[int, float]) -> None:
    reqs = load_trace(TRACES / f"{name}.jsonl")
    assert infinite_cache_hit_rate(reqs) == pytest.approx(ideal, abs=0.005)
    for capacity, expected in lru.items():
        assert pooled_lru_hit_rate(reqs, capacity) == pytest.approx(expected, abs=0.005)


@st.composite
def chained_traces(draw: st.DrawFn) -> list[SimRequest]:
    """Random requests whose block ids follow Mooncake semantics (a trie of prefixes)."""
    children: dict[tuple[int, int], int] = {}
    reqs = []
    for i in range(draw(st.integers(1, 25))):
        parent, ids = -1, []
        for branch in draw(st.lists(st.integers(0, 2), min_size=1, max_size=6)):
            parent = children.setdefault((parent, branch), len(children))
            ids.append(parent)
        reqs.append(req(i, tuple(ids)))
    return reqs


@given(chained_traces(), st.integers(0, 30))
def test_lru_is_bounded_by_the_infinite_cache_and_monotone_in_capacity(
    trace: list[SimRequest], cap: int
) -> None:
    smaller, larger = pooled_lru_hit_rate(trace, cap), pooled_lru_hit_rate(trace, cap + 1)
    assert 0.0 <= smaller <= larger <= infinite_cache_hit_rate(trace) + 1e-12
    assert pooled_lru_hit_rate(trace, 10_000) == pytest.approx(infinite_cache_hit_rate(trace))


def test_ttft_floor_computes_only_the_never_seen_part_on_an_idle_worker() -> None:
    profile = load_profile("h100-llama3.1-8b")
    first = SimRequest(0, 0.0, 1024, 1, (1, 2), (512, 512))
    second = SimRequest(1, 1.0, 1024, 1, (1, 3), (512, 512))  # block 1 seen: only 512 new tokens
    assert ttft_floor([first, second], profile, q=100) == prefill_time_s(profile, 1024, 0)
    assert ttft_floor([first, second], profile, q=0) == prefill_time_s(profile, 512, 512)
