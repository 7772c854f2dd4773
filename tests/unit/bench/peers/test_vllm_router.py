"""vllm-router `cache_aware`: per-worker match, least-loaded among the best holders, imbalance gate."""

from __future__ import annotations

from bench.peers.vllm_router import make_router
from tests.unit.bench.peers.fake_cluster import FakeCluster, request

WORKERS = ["w0", "w1", "w2"]


def test_a_prefix_two_workers_hold_goes_to_the_less_loaded_holder() -> None:
    router = make_router(0)
    router.tree.insert([1, 2], [512, 512], "w2")  # w2 created it (SGLang would pick w2)
    router.tree.insert([1, 2], [512, 512], "w0")
    cluster = FakeCluster(WORKERS, inflight_by={"w2": 10, "w0": 3, "w1": 0})
    assert router.route(request([1, 2, 3, 4]), cluster, 0.0) == "w0"  # 2 of 4 blocks = 0.5 > 0.3
    assert router.last_reason == "cache hit"


def test_the_match_stops_at_the_first_block_a_worker_does_not_hold() -> None:
    router = make_router(0)
    router.tree.insert([1], [512], "w0")
    router.tree.insert([1, 2, 3], [512, 512, 512], "w1")
    cluster = FakeCluster(WORKERS, inflight_by={"w0": 0, "w1": 5, "w2": 0})
    assert router.route(request([1, 2, 3, 4]), cluster, 0.0) == "w1"  # w1 3/4, w0 only 1/4


def test_short_match_or_imbalance_goes_to_least_load() -> None:
    router = make_router(0)
    router.tree.insert([1], [512], "w1")
    cluster = FakeCluster(WORKERS, inflight_by={"w0": 2, "w1": 0, "w2": 1})
    assert router.route(request([1, 2, 3, 4]), cluster, 0.0) == "w1"  # 0.25 <= 0.3: least load (w1)
    assert router.last_reason == "miss: least load"
    router.tree.insert([5, 6], [512, 512], "w0")
    cluster = FakeCluster(WORKERS, inflight_by={"w0": 100, "w1": 30, "w2": 20})
    assert router.route(request([5, 6]), cluster, 0.0) == "w2"
    assert router.last_reason == "imbalanced"


def test_the_chosen_worker_learns_the_prompt() -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS)
    first = router.route(request([7, 8]), cluster, 0.0)
    assert router.route(request([7, 8, 9]), cluster, 1.0) == first
