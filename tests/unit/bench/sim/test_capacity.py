"""Measured capacity (bench/sim/capacity.py) and the overload scenario calibrated on it: the burst asks
for 2x what the engines serve, the steady phases 0.6x, the half-load reference 0.5x, each checked by
saturating one engine with that very mix."""

from __future__ import annotations

import pytest

from bench.sim.baselines import LeastInflight
from bench.sim.capacity import MEASURE_S, capacity_rps, finish_rate_rps, utilisation
from bench.sim.cluster import simulate
from bench.sim.profiles import load_profile
from bench.sim.scenarios import (
    HALF_LOAD_SCALE,
    OVERLOAD_STREAMS,
    overload_requests,
    overload_utilisation,
    stream_alone,
    stream_capacity_rps,
)
from bench.sim.types import SimRequest

PROFILE = load_profile("h100-llama3.1-8b")
STREAMS = {s.name: s for s in OVERLOAD_STREAMS}


@pytest.mark.parametrize("name", ["chat", "batch"])
def test_capacity_is_a_saturated_rate_that_more_arrivals_do_not_raise(name: str) -> None:
    stream = STREAMS[name]
    capacity = stream_capacity_rps(PROFILE, stream)
    harder = finish_rate_rps(PROFILE, stream_alone(stream, 3 * capacity, MEASURE_S), MEASURE_S)
    assert harder == pytest.approx(capacity, rel=0.06)
    lighter = 0.5 * capacity  # below capacity the engine finishes what arrives, not its capacity
    kept_up = finish_rate_rps(PROFILE, stream_alone(stream, lighter, MEASURE_S), MEASURE_S)
    assert 0.6 * lighter < kept_up < 0.8 * capacity


def test_short_online_requests_serve_faster_than_long_batch_prompts() -> None:
    chat, api, batch = (stream_capacity_rps(PROFILE, STREAMS[n]) for n in ("chat", "api", "batch"))
    assert chat > api > 5 * batch


def test_capacity_rps_raises_the_overdrive_until_the_engine_saturates() -> None:
    stream = STREAMS["chat"]
    tried: list[float] = []

    def source(rate: float, span_s: float) -> list[SimRequest]:
        tried.append(rate)
        return stream_alone(stream, rate, span_s)

    sample = stream_alone(stream, 1.0, 200.0)
    # a sample of the longest requests makes the first overdrive too low to saturate: it must double
    longest = sorted(sample, key=lambda r: r.input_tokens + 20 * r.output_tokens)[-10:]
    capacity = capacity_rps(PROFILE, source, longest)
    assert capacity == pytest.approx(stream_capacity_rps(PROFILE, stream), rel=0.06)
    assert tried == sorted(tried) and capacity < 0.8 * tried[-1]


def test_utilisation_sums_each_kind_against_its_own_capacity() -> None:
    assert utilisation({"a": 10.0, "b": 1.0}, {"a": 20.0, "b": 4.0}, 2) == pytest.approx(0.25 + 0.125)


def mix_load(load_scale: float, burst: bool, phases: tuple[float, float, float]) -> float:
    """The scenario's mix over one engine: capacity units arriving per second ÷ capacity units the
    engine finishes per second when saturated by that very mix (a request of a stream = 1 / the
    stream's capacity_rps units, so a mix that follows the model serves 1 unit per second)."""
    span = sum(phases)
    reqs = overload_requests(1, PROFILE, 1, load_scale=load_scale, burst=burst, phases_s=phases)
    capacity = {s.name: stream_capacity_rps(PROFILE, s) for s in OVERLOAD_STREAMS}
    unit = {t: 1 / capacity[s.name] for s in OVERLOAD_STREAMS for t in s.tenants}
    by_id = {r.id: r for r in reqs}
    result = simulate(reqs, LeastInflight(), PROFILE, 1)
    start = span / 3
    served = sum(
        unit[by_id[r.id].tenant]
        for r in result.records
        if r.finish_s is not None and start <= r.finish_s < span
    ) / (span - start)
    arrived = sum(unit[r.tenant] for r in reqs) / span
    return arrived / served


@pytest.mark.parametrize(
    ("load_scale", "burst", "phases", "expected"),
    [
        pytest.param(1.0, True, (0.0, MEASURE_S, 0.0), 2.0, id="burst mix at 2x"),
        # below capacity the engine keeps up, so the steady mix is overdriven 3x to measure it
        pytest.param(3.0, False, (MEASURE_S, 0.0, 0.0), 3 * 0.6, id="steady mix at 0.6x (3x overdriven)"),
        pytest.param(
            3 * HALF_LOAD_SCALE, False, (MEASURE_S, 0.0, 0.0), 3 * 0.5, id="half-load mix at 0.5x (3x)"
        ),
    ],
)
def test_overload_phases_ask_for_their_share_of_measured_capacity(
    load_scale: float, burst: bool, phases: tuple[float, float, float], expected: float
) -> None:
    assert mix_load(load_scale, burst, phases) == pytest.approx(expected, rel=0.1)


@pytest.mark.parametrize("workers", [2, 8])
def test_phase_utilisation_is_steady_then_twice_capacity_then_steady(workers: int) -> None:
    reqs = overload_requests(1, PROFILE, workers)
    capacity = {s.name: stream_capacity_rps(PROFILE, s) for s in OVERLOAD_STREAMS}
    stream_of = {t: s.name for s in OVERLOAD_STREAMS for t in s.tenants}
    loads = []
    for lo, hi in ((0.0, 60.0), (60.0, 120.0), (120.0, 210.0)):
        counts: dict[str, float] = {}
        for r in reqs:
            if lo <= r.arrival_s < hi:
                counts[stream_of[r.tenant]] = counts.get(stream_of[r.tenant], 0.0) + 1 / (hi - lo)
        loads.append(utilisation(counts, capacity, workers))
    tolerance = 0.1 if workers == 8 else 0.2  # Poisson counts: few batch requests on 2 workers
    assert loads == pytest.approx([0.6, 2.0, 0.6], rel=tolerance)


def test_the_reported_load_is_the_whole_run_against_measured_capacity() -> None:
    """0.6 x 60 s + 2.0 x 60 s + 0.6 x 90 s = 1.0 of capacity over 210 s (results.json `load`)."""
    from bench.sim.runner import overload_workload

    assert overload_utilisation(overload_requests(1, PROFILE, 8), PROFILE, 8) == pytest.approx(1.0, rel=0.05)
    half = overload_requests(1, PROFILE, 8, load_scale=HALF_LOAD_SCALE, burst=False)
    assert overload_utilisation(half, PROFILE, 8) == pytest.approx(0.5, rel=0.05)
    workload = overload_workload(PROFILE, 2, 1, 1000, None)
    assert workload.plan.load == overload_utilisation(workload.requests, PROFILE, 2)
