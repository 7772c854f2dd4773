"""SMG 1.13 `cache_aware`: overload protection from scraped metrics, the spill gate, SGLang's match."""

from __future__ import annotations

from bench.peers.smg import SmgRouter, make_router, spill_margin
from bench.sim.types import Scraped
from tests.unit.bench.peers.fake_cluster import FakeCluster, request

WORKERS = ["w0", "w1", "w2"]


def scraped(waiting: int = 0, kv: float = 0.0) -> Scraped:
    return Scraped(at_s=0.0, running=0, waiting=waiting, kv_usage=kv)


def test_a_holder_over_the_kv_or_queue_ceiling_is_left_out() -> None:
    for over in (scraped(kv=0.8), scraped(waiting=8)):
        router = make_router(0)
        router.tree.insert([1, 2], [2048, 2048], "w1")
        cluster = FakeCluster(WORKERS, inflight_by={"w0": 3, "w1": 0, "w2": 1}, scraped_by={"w1": over})
        assert router.route(request([1, 2, 3]), cluster, 0.0) == "w2"  # least loaded of w0, w2
        assert router.last_reason == "holder overloaded: least load"


def test_every_worker_overloaded_goes_to_least_load_and_protection_can_be_off() -> None:
    over = {w: scraped(kv=0.95) for w in WORKERS}
    router = make_router(0)
    router.tree.insert([1, 2], [2048, 2048], "w0")
    cluster = FakeCluster(WORKERS, inflight_by={"w0": 2, "w1": 1, "w2": 0}, scraped_by=over)
    assert router.route(request([1, 2, 3]), cluster, 0.0) == "w2"
    off = SmgRouter(overload_protection=False)
    off.tree.insert([1, 2], [2048, 2048], "w0")
    assert off.route(request([1, 2, 3]), cluster, 0.0) == "w0"


def test_spill_gate_needs_margin_and_ratio_over_the_mean() -> None:
    assert spill_margin(0.0) == 4.0 and spill_margin(100.0) == 20.0 and spill_margin(10_000.0) == 64
    router = make_router(0)
    router.tree.insert([1, 2], [2048, 2048], "w0")
    # mean 4, margin 4: w0 at 10 > 8 and > 6 -> spill to the least loaded
    cluster = FakeCluster(WORKERS, inflight_by={"w0": 10, "w1": 2, "w2": 0})
    assert router.route(request([1, 2, 3]), cluster, 0.0) == "w2"
    assert router.last_reason == "spill"
    router = make_router(0)
    router.tree.insert([1, 2], [2048, 2048], "w0")
    cluster = FakeCluster(WORKERS, inflight_by={"w0": 7, "w1": 2, "w2": 0})  # 7 <= 3 + 4: stays
    assert router.route(request([1, 2, 3]), cluster, 0.0) == "w0"
