"""CHWBL: ring walk from the key's home, skipping workers whose load would pass ceil(c * average)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.peers.chwbl import ChwblRouter, make_router
from bench.peers.common import hash64
from tests.unit.bench.peers.fake_cluster import FakeCluster, request

WORKERS = ["w0", "w1", "w2", "w3"]


def ring_order(router: ChwblRouter, first_block: int) -> list[str]:
    return router.walk(hash64(f"block:{first_block}"), WORKERS)


def test_config_rejects_c_not_above_one() -> None:
    with pytest.raises(ValueError, match="c must be > 1"):
        ChwblRouter(c=1.0)


def test_idle_cluster_sends_a_key_to_its_ring_home_every_time() -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS)
    home = ring_order(router, 7)[0]
    assert {router.route(request([7, 100 + i], rid=i), cluster, 0.0) for i in range(5)} == {home}


@pytest.mark.parametrize(
    ("home_load", "expect_home"),
    [
        # others idle: total = home_load, cap = ceil(1.25 * (home_load + 1) / 4)
        pytest.param(0, True, id="idle home: cap 1, 0 + 1 <= 1"),
        pytest.param(1, False, id="home at 1: cap ceil(2.5/4)=1, 1 + 1 > 1 -> next on ring"),
    ],
)
def test_walks_past_a_worker_above_the_bound(home_load: int, expect_home: bool) -> None:
    router = make_router(0)
    order = ring_order(router, 7)
    cluster = FakeCluster(WORKERS, inflight_by={order[0]: home_load})
    chosen = router.route(request([7]), cluster, 0.0)
    assert chosen == (order[0] if expect_home else order[1])


def test_skips_every_full_worker_in_ring_order() -> None:
    router = make_router(0)
    order = ring_order(router, 3)
    # total 8 -> cap = ceil(1.25 * 9 / 4) = 3; first two at 3 (full), third at 2 (fits)
    cluster = FakeCluster(WORKERS, inflight_by={order[0]: 3, order[1]: 3, order[2]: 2, order[3]: 0})
    assert router.route(request([3]), cluster, 0.0) == order[2]


def test_different_keys_reach_every_worker() -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS)
    assert {router.route(request([k]), cluster, 0.0) for k in range(200)} == set(WORKERS)


@given(
    loads=st.lists(st.integers(min_value=0, max_value=50), min_size=4, max_size=4),
    key=st.integers(min_value=0, max_value=10**9),
)
def test_chosen_worker_stays_within_the_load_bound(loads: list[int], key: int) -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS, inflight_by=dict(zip(WORKERS, loads, strict=True)))
    chosen = router.route(request([key]), cluster, 0.0)
    cap = math.ceil(1.25 * (sum(loads) + 1) / len(WORKERS))
    assert cluster.inflight(chosen) + 1 <= cap
