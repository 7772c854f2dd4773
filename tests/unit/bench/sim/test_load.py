"""Offered load: scaling hits F exactly, keeps the arrival shape, and rejects impossible input."""

from __future__ import annotations

import pytest

from bench.sim.load import B_REF, decode_token_cost_s, offered_load, request_work_s, scale_to_load
from bench.sim.profiles import decode_step_s, load_profile, prefill_time_s
from bench.sim.scenarios import build_scenario
from bench.sim.types import SimRequest

PROFILE = load_profile("h100-llama3.1-8b")


def req(i: int, at: float, inp: int = 2048, out: int = 100) -> SimRequest:
    return SimRequest(i, at, inp, out, (i,), (inp,))


def test_work_of_one_request_follows_the_definition() -> None:
    reqs = [req(0, 0.0, 2048, 100), req(1, 1.0, 4096, 300)]
    ctx_mean = ((2048 + 50) + (4096 + 150)) / 2
    per_token = decode_step_s(PROFILE, B_REF, int(B_REF * ctx_mean)) / B_REF
    assert decode_token_cost_s(PROFILE, reqs) == pytest.approx(per_token)
    assert request_work_s(PROFILE, reqs[1], per_token) == pytest.approx(
        prefill_time_s(PROFILE, 4096, 0) + 300 * per_token
    )


@pytest.mark.parametrize("load", [0.4, 0.8, 1.0, 1.5])
@pytest.mark.parametrize("workers", [1, 8])
def test_scaling_hits_the_requested_load(load: float, workers: int) -> None:
    reqs = build_scenario("burst", seed=3, limit=400)
    scaled, plan = scale_to_load(PROFILE, reqs, workers, load)
    assert offered_load(PROFILE, scaled, workers) == pytest.approx(load, rel=1e-9)
    assert plan.span_s == pytest.approx(scaled[-1].arrival_s)
    assert plan.work_s / (plan.span_s * workers) == pytest.approx(load)


def test_scaling_keeps_order_content_and_shape() -> None:
    reqs = [req(0, 10.0), req(1, 11.0), req(2, 14.0)]
    scaled, plan = scale_to_load(PROFILE, reqs, 2, 0.5)
    assert [r.id for r in scaled] == [0, 1, 2]
    assert scaled[0].arrival_s == 0.0
    gaps = [scaled[1].arrival_s - scaled[0].arrival_s, scaled[2].arrival_s - scaled[1].arrival_s]
    assert gaps[1] == pytest.approx(3 * gaps[0])
    assert [r.block_ids for r in scaled] == [r.block_ids for r in reqs]
    assert plan.time_scale == pytest.approx(scaled[2].arrival_s / 4.0)


@pytest.mark.parametrize(
    ("reqs", "workers", "load", "message"),
    [
        pytest.param([req(0, 0.0), req(1, 1.0)], 2, 0.0, "load must be > 0", id="zero load"),
        pytest.param([req(0, 0.0), req(1, 1.0)], 0, 0.5, "workers must be > 0", id="no workers"),
        pytest.param([req(0, 1.0), req(1, 1.0)], 2, 0.5, "same time", id="no arrival span"),
        pytest.param([], 2, 0.5, "no requests", id="empty"),
    ],
)
def test_bad_input(reqs: list[SimRequest], workers: int, load: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scale_to_load(PROFILE, reqs, workers, load)
