"""flap_rate on constructed runs (engine truth: who holds the prefix, whether it is overloaded) and the
per-request TTFT floor behind slowdown."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import pytest

from bench.sim.bounds import ttft_floor, ttft_floors
from bench.sim.cluster import simulate
from bench.sim.metrics import compute_metrics
from bench.sim.profiles import load_profile, prefill_time_s
from bench.sim.types import ClusterView, NoFeedback, SimRequest

PROFILE = load_profile("h100-llama3.1-8b")
PREFIX = tuple(range(1, 17))  # 16 blocks = 8,192 shared tokens


class Scripted(NoFeedback):
    """Routes request i to `plan[i]` (a router that does what the test says)."""

    name = "scripted"

    def __init__(self, plan: Sequence[str]) -> None:
        self.plan = plan

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        return self.plan[req.id]


def hot(i: int, at: float) -> SimRequest:
    """The shared prefix plus one unique block, arriving at `at`."""
    ids = (*PREFIX, 1000 + i)
    return SimRequest(i, at, 512 * len(ids), 4, ids, (512,) * len(ids))


def big(i: int, at: float) -> SimRequest:
    """A 64k-token unrelated prompt: queues ~7 s of prefill on its worker."""
    ids = tuple(range(5000 + 200 * i, 5000 + 200 * i + 128))
    return SimRequest(i, at, 512 * len(ids), 4, ids, (512,) * len(ids))


def run(requests: list[SimRequest], plan: list[str], workers: int = 2) -> dict[str, object]:
    result = simulate(requests, Scripted(plan), PROFILE, workers)
    return compute_metrics(result, requests, PROFILE)


def test_moving_a_hot_prefix_off_an_idle_holder_is_a_flap() -> None:
    reqs = [hot(0, 0.0), hot(1, 5.0), hot(2, 10.0), hot(3, 15.0)]
    m = run(reqs, ["w0", "w0", "w1", "w0"])
    # req 1 and 3 stay on a holder; req 2 leaves idle holder w0 for w1: 1 flap of 3 hot requests
    assert m["flap_requests"] == 3
    assert m["flap_rate"] == pytest.approx(1 / 3)
    assert m["switch_rate"] == pytest.approx(2 / 3)  # switch_rate also counts the move back to w0


def test_spreading_over_workers_that_all_hold_it_is_no_flap() -> None:
    reqs = [hot(0, 0.0), hot(1, 5.0), hot(2, 10.0), hot(3, 15.0), hot(4, 20.0)]
    m = run(reqs, ["w0", "w1", "w0", "w1", "w0"])  # req 1 is the one flap: w0 held it, idle
    assert m["flap_rate"] == pytest.approx(1 / 4)
    assert m["switch_rate"] == pytest.approx(1.0)


def test_leaving_an_overloaded_holder_is_no_flap() -> None:
    # w0 holds the prefix but has ~8 big prefills queued when req 9 arrives: leaving it saves time
    reqs = [hot(0, 0.0)] + [big(i, 4.0) for i in range(1, 9)] + [hot(9, 4.5)]
    m = run(reqs, ["w0"] * 9 + ["w1"])
    assert m["flap_requests"] == 1
    assert m["flap_rate"] == 0.0


def test_no_holder_left_is_no_flap() -> None:
    # hot by the request history, but at the same instant w0 has not computed the prefix yet
    reqs = [hot(0, 0.0), hot(1, 0.0)]
    m = run(reqs, ["w0", "w1"])
    assert m["flap_requests"] == 1 and m["flap_rate"] == 0.0


def test_a_request_that_bypasses_the_router_is_no_routing_decision() -> None:
    # req 2 reaches w1 directly (churn's direct clients) while w0 holds the prefix: not the router's move
    tenant = next(t for t in (f"t{i}" for i in range(100)) if zlib.crc32(t.encode()) % 2 == 1)
    direct = dataclasses.replace(hot(2, 10.0), bypass=True, tenant=tenant)
    m = run([hot(0, 0.0), hot(1, 5.0), direct, hot(3, 15.0)], ["w0", "w0", "-", "w0"])
    assert m["flap_requests"] == 2 and m["flap_rate"] == 0.0
    # the same move made by the router is a flap
    m = run([hot(0, 0.0), hot(1, 5.0), hot(2, 10.0), hot(3, 15.0)], ["w0", "w0", "w1", "w0"])
    assert m["flap_requests"] == 3 and m["flap_rate"] == pytest.approx(1 / 3)


def test_floor_is_the_compulsory_miss_prefill_and_an_idle_run_has_slowdown_one() -> None:
    reqs = [hot(0, 0.0), hot(1, 30.0), hot(2, 60.0)]
    floors = ttft_floors(reqs, PROFILE)
    assert floors[0] == pytest.approx(prefill_time_s(PROFILE, 512 * 17, 0))
    assert floors[1] == pytest.approx(prefill_time_s(PROFILE, 512, 512 * 16))
    assert ttft_floor(reqs, PROFILE, 100.0) == pytest.approx(max(floors))
    m = run(reqs, ["w0", "w0", "w0"])
    assert m["slowdown_p50"] == pytest.approx(1.0, rel=0.05)
    assert m["slowdown_p99"] == pytest.approx(1.0, rel=0.05)


def test_queueing_shows_up_as_slowdown() -> None:
    reqs = [big(i, 0.0) for i in range(4)]
    m = run(reqs, ["w0"] * 4, workers=1)
    assert m["slowdown_p99"] > 3.0  # the last of four equal prefills waits for the other three
