"""Offered load: time-scale a workload's arrivals so it asks for a given fraction F of cluster capacity.

Work is measured with no cache hits, so every policy sees the identical arrival sequence and a policy's
cache reuse shows up as spare capacity rather than as a different load:
  W(req)   = prefill_time_s(profile, input_tokens, ctx=0) + output_tokens * decode_token_s
  decode_token_s = decode_step_s(profile, B_REF, B_REF * ctx_mean) / B_REF   (B_REF = 64 sequences,
             ctx_mean = mean over requests of input_tokens + output_tokens / 2: a decode step's cost
             shared by a reference batch, i.e. per-token decode cost of a moderately busy engine)
  capacity = workers * 1 work-second per second
  F        = sum(W) / (span * workers),   span = last arrival - first arrival after scaling
Arrivals are multiplied by one factor (gaps, bursts and think times keep their shape); requests keep
their ids and content. Scaling needs at least two distinct arrival times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.sim.profiles import EngineProfile, decode_step_s, prefill_time_s
from bench.sim.types import SimRequest

B_REF = 64  # reference decode batch for the per-token decode cost


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """How a workload was scaled: the numbers behind the offered load, reported in results.json."""

    load: float  # F, fraction of cluster capacity
    work_s: float  # sum of W over the workload
    span_s: float  # arrival span after scaling
    time_scale: float  # new arrival = old arrival * time_scale
    decode_token_s: float  # per-token decode cost used in W


def decode_token_cost_s(profile: EngineProfile, requests: Sequence[SimRequest]) -> float:
    """Per output token decode cost at the reference batch and the workload's mean context."""
    ctx_mean = sum(r.input_tokens + r.output_tokens / 2 for r in requests) / len(requests)
    return decode_step_s(profile, B_REF, int(B_REF * ctx_mean)) / B_REF


def request_work_s(profile: EngineProfile, req: SimRequest, decode_token_s: float) -> float:
    """W of one request: cold prefill plus its decode tokens at the reference per-token cost."""
    return prefill_time_s(profile, req.input_tokens, 0) + req.output_tokens * decode_token_s


def total_work_s(profile: EngineProfile, requests: Sequence[SimRequest]) -> float:
    per_token = decode_token_cost_s(profile, requests)
    return sum(request_work_s(profile, r, per_token) for r in requests)


def offered_load(profile: EngineProfile, requests: Sequence[SimRequest], workers: int) -> float:
    """F of a workload as it stands (its current arrival times)."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    if span <= 0:
        raise ValueError("offered load needs at least two distinct arrival times")
    return total_work_s(profile, requests) / (span * workers)


def scale_to_load(
    profile: EngineProfile, requests: Sequence[SimRequest], workers: int, load: float
) -> tuple[list[SimRequest], LoadPlan]:
    """Requests (sorted by arrival) with arrivals rescaled so that the offered load is `load`."""
    if load <= 0:
        raise ValueError(f"load must be > 0, got {load}")
    if workers <= 0:
        raise ValueError(f"workers must be > 0, got {workers}")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    if not ordered:
        raise ValueError("workload has no requests")
    start = ordered[0].arrival_s
    span = ordered[-1].arrival_s - start
    if span <= 0:
        raise ValueError("cannot scale a workload whose requests all arrive at the same time")
    per_token = decode_token_cost_s(profile, ordered)
    work = sum(request_work_s(profile, r, per_token) for r in ordered)
    target_span = work / (workers * load)
    factor = target_span / span
    scaled = [replace(r, arrival_s=(r.arrival_s - start) * factor) for r in ordered]
    return scaled, LoadPlan(load, work, target_span, factor, per_token)
