"""Measured capacity: the request rate one engine sustains for one kind of traffic, from a saturated run.

The overload scenario states its loads as fractions of this rather than of bench/sim/load.py's W: W
prices every decode token at one 64-sequence batch and the workload's mean context, so it overprices
short online requests (an engine batches hundreds of them and keeps their system prompts cached) and
underprices long batch prompts (their KV caps the batch). On h100-llama3.1-8b the overload streams'
measured capacities are 2.2x (chat), 1.3x (api) and 0.57x (batch) the rates W gives them in the mix,
so the W-calibrated burst asked for 1.78x what the engines serve, and 0.87x once the low band was shed.

  capacity_rps(kind) = requests one engine finishes per second in [T/3, T) while Poisson arrivals of
                       that kind alone come at >= 4x its W rate for T = 90 s (a standing backlog, the
                       engine's own FCFS queue; raised until the finishes lag the arrivals).
  utilisation of a mix = sum over kinds of rate_i / (workers * capacity_rps_i).

One engine stands for the cluster: at saturation a balancing router keeps every worker busy, and each
holds the few per-tenant system prompts of a kind. The sum is a model, checked by measuring mixes the
same way (tests/unit/bench/sim/test_capacity.py: the overload scenario's steady, burst and half-load
mixes ask for 0.6x, 2.0x and 0.5x of what one engine then serves of them, within 10 %).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bench.sim.baselines import LeastInflight
from bench.sim.cluster import simulate
from bench.sim.load import decode_token_cost_s, request_work_s
from bench.sim.profiles import EngineProfile
from bench.sim.types import SimRequest

MEASURE_S = 90.0  # arrival window of a capacity run; finishes are counted in its last two thirds
OVERDRIVE = 4.0  # first try: arrivals at this multiple of the W rate
SATURATED = 0.8  # a run counts as saturated while finishes stay below this share of arrivals

# (rate requests/s, duration s) -> requests of one kind, arrivals sorted, Poisson at `rate`
KindSource = Callable[[float, float], list[SimRequest]]


def finish_rate_rps(profile: EngineProfile, requests: Sequence[SimRequest], duration_s: float) -> float:
    """Requests one engine of `profile` finishes per second in [duration/3, duration)."""
    result = simulate(requests, LeastInflight(), profile, 1)
    start = duration_s / 3
    done = sum(1 for r in result.records if r.finish_s is not None and start <= r.finish_s < duration_s)
    return done / (duration_s - start)


def w_rate_rps(profile: EngineProfile, sample: Sequence[SimRequest]) -> float:
    """The rate at which a kind's W (load.py, its own decode cost) fills one engine: 1 / mean W."""
    per_token = decode_token_cost_s(profile, sample)
    return len(sample) / sum(request_work_s(profile, r, per_token) for r in sample)


def capacity_rps(profile: EngineProfile, source: KindSource, sample: Sequence[SimRequest]) -> float:
    """Saturation throughput of one engine for the kind `source` draws (`sample`: some of its requests,
    to size the first overdrive)."""
    rate = OVERDRIVE * w_rate_rps(profile, sample)
    for _ in range(4):
        served = finish_rate_rps(profile, source(rate, MEASURE_S), MEASURE_S)
        if served < SATURATED * rate:
            return served
        rate *= 2
    raise RuntimeError(f"no saturation up to {rate / 2:.1f} requests/s: the engine model looks unbounded")


def utilisation(rates_rps: dict[str, float], capacities_rps: dict[str, float], workers: int) -> float:
    """Fraction of the cluster's capacity a mix asks for: sum of rate / (workers * capacity) per kind."""
    return sum(rate / (workers * capacities_rps[kind]) for kind, rate in rates_rps.items())
