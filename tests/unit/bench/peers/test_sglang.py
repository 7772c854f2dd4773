"""SGLang `cache_aware`: imbalance gate, match-rate threshold, and the two miss rules."""

from __future__ import annotations

import pytest

from bench.peers.sglang import SglangRouter, make_legacy_router, make_router
from bench.sim.types import SimRequest
from tests.unit.bench.peers.fake_cluster import FakeCluster, request

WORKERS = ["w0", "w1", "w2"]


def test_config_rejects_threshold_outside_unit_interval() -> None:
    with pytest.raises(ValueError, match="cache_threshold"):
        SglangRouter(cache_threshold=1.5)


@pytest.mark.parametrize(
    ("loads", "expect"),
    [
        pytest.param([100, 30, 20], "w2", id="abs 80 > 64 and 100 > 1.5*20: imbalanced -> least load"),
        pytest.param([300, 250, 210], "w1", id="abs 90 but 300 <= 1.5*210: balanced -> cache tenant"),
        pytest.param([60, 0, 0], "w1", id="abs 60 <= 64: balanced -> cache tenant"),
        pytest.param([100, 30, 30], "w1", id="imbalanced, tie at least load -> registry order"),
    ],
)
def test_imbalance_gate_needs_both_thresholds(loads: list[int], expect: str) -> None:
    router = make_router(0)
    router.tree.insert([1, 2, 3], [2048, 2048, 2048], "w1")  # w1 holds the whole prompt
    cluster = FakeCluster(WORKERS, inflight_by=dict(zip(WORKERS, loads, strict=True)))
    assert router.route(request([1, 2, 3]), cluster, 0.0) == expect


def test_hit_above_threshold_goes_to_the_first_inserter_even_if_busier() -> None:
    router = make_router(0)
    router.tree.insert([1, 2], [2048, 2048], "w2")
    router.tree.insert([1, 2], [2048, 2048], "w0")  # w0 also holds it, but w2 created it
    cluster = FakeCluster(WORKERS, inflight_by={"w2": 10})
    # matched 2 of 4 blocks = 0.5 > 0.3
    assert router.route(request([1, 2, 30, 31]), cluster, 0.0) == "w2"
    assert router.last_reason == "cache hit"


@pytest.mark.parametrize(
    ("factory", "expect", "reason"),
    [
        pytest.param(make_router, "w1", "miss: least load", id="current: miss -> least load"),
        pytest.param(make_legacy_router, "w0", "miss: smallest tree", id="legacy: miss -> smallest tree"),
    ],
)
def test_miss_rules(factory: object, expect: str, reason: str) -> None:
    router = factory(0)  # type: ignore[operator]
    router.tree.insert([1], [2048], "w2")  # w2 holds 1 of 4 blocks (rate 0.25 <= 0.3)
    router.tree.insert([9, 10], [2048, 2048], "w1")  # w1's tree is bigger than w0's (empty)
    cluster = FakeCluster(WORKERS, inflight_by={"w0": 3, "w1": 1, "w2": 2})
    assert router.route(request([1, 20, 21, 22]), cluster, 0.0) == expect
    assert router.last_reason == reason


def test_rate_exactly_at_threshold_is_a_miss() -> None:
    router = make_router(0)
    router.tree.insert([1], [300 * 4], "w2")
    cluster = FakeCluster(WORKERS, inflight_by={"w2": 1})
    # 1200 of 4000 chars = 0.3, not > 0.3
    req = SimRequest(
        id=0, arrival_s=0.0, input_tokens=1000, output_tokens=1, block_ids=(1, 2), block_tokens=(300, 700)
    )
    assert router.route(req, cluster, 0.0) == "w0"


def test_routed_prompt_is_inserted_so_the_next_turn_sticks() -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS, inflight_by={"w0": 2, "w1": 2, "w2": 1})
    first = router.route(request([1, 2]), cluster, 0.0)
    assert first == "w2"
    cluster.inflight_by = {"w0": 0, "w1": 0, "w2": 3}
    assert router.route(request([1, 2, 3]), cluster, 1.0) == "w2"


def test_eviction_every_interval_trims_oldest_leaves_of_oversized_tenants() -> None:
    router = SglangRouter(max_tree_size_chars=3 * 2048, eviction_interval_s=60.0)
    cluster = FakeCluster(WORKERS)
    router.route(request([1, 2, 3]), cluster, 0.0)  # w0: 3 blocks
    router.route(request([1, 4]), cluster, 1.0)  # w0 (hit): 4 blocks, 8192 chars > 6144
    assert router.tree.tenant_chars("w0") == 4 * 2048
    router.route(request([50]), FakeCluster(WORKERS, inflight_by={"w0": 1}), 59.0)  # before the tick
    assert router.tree.tenant_chars("w0") == 4 * 2048
    router.route(request([60]), FakeCluster(WORKERS, inflight_by={"w0": 1, "w1": 1}), 61.0)
    # the oldest leaf (block 3) went; blocks 1, 2 and 4 stayed
    assert router.tree.tenant_chars("w0") == 3 * 2048
    assert router.tree.match([1, 2, 3]) == ("w0", 4096)
    assert router.tree.match([1, 4]) == ("w0", 4096)
