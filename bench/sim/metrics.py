"""Per-policy metrics of one simulated run (the `metrics` object of results.json).

Definitions (times in seconds from the request's arrival; rates as fractions):
  hit_rate        token-weighted prefix hit rate: sum(cached_tokens) / sum(input_tokens) over requests
                  that got a first token; cached_tokens are reported by the engine when it schedules them.
  ttft_*          first_token - arrival (includes any admission wait); p50/p90/p99.
  e2e_*           finish - arrival; p50/p99.
  queue_*         queueing delay = time to first token not explained by computing the prefill:
                  max(0, ttft - prefill_time_s(uncached tokens, ctx = cached tokens)), i.e. admission wait
                  + wait in the engine's queue + slow-down from sharing steps with other requests.
  throughput_rps  finished requests / duration; throughput_tok_s: their output tokens / duration;
                  duration = first arrival (0) to last finish.
  per_worker_util useful work each worker did / duration: for every request it served,
                  prefill_time_s(input - cached, ctx = cached) + output_tokens * decode_token_s (the
                  load model's per-token decode cost, bench/sim/load.py). Engine busy time is no use
                  here: under continuous batching an engine with any request steps all the time, so
                  busy time saturates near 1 on every worker (kept as `per_worker_busy`).
                  util_cv = population std / mean of per_worker_util.
  switch_rate     hot-prefix switches / counted pairs (see `switch_rate`).
  flap_rate       hot-prefix requests sent to a worker that did not hold the prefix while a holder was
                  not overloaded / hot-prefix requests (engine truth; bench/sim/hot_prefix.py).
  slowdown_*      per request TTFT / its TTFT floor (bench/sim/bounds.py `ttft_floors`: its own
                  compulsory-miss prefill on an idle worker); p50/p99 over requests with a first token.
Extra balance measures: inflight_cv = CV of each worker's time-averaged requests in flight;
prefill_tokens_cv = CV of the prompt tokens each worker computed (input - cached).
Percentiles interpolate linearly between order statistics (numpy's default "linear").
With an admission gate (`admission_metrics`): goodput = requests finishing with TTFT within their SLO
/ all requests (rejected ones count as not good), and per-band TTFT, completions, rejections, max wait.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.bounds import ttft_floors
from bench.sim.cluster import RequestRecord, SimResult
from bench.sim.hot_prefix import HOT_WINDOW_S, HotPrefixes
from bench.sim.load import decode_token_cost_s
from bench.sim.profiles import EngineProfile, prefill_time_s
from bench.sim.types import SimRequest
from bench.stats import percentile
from policy.types import Band

METRIC_NAMES = (
    "hit_rate",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "e2e_p50",
    "e2e_p99",
    "queue_p50",
    "queue_p99",
    "throughput_rps",
    "throughput_tok_s",
    "util_cv",
    "switch_rate",
    "flap_rate",
    "slowdown_p50",
    "slowdown_p99",
)


def switch_stats(
    requests: Sequence[SimRequest], workers: Sequence[str | None], window_s: float = HOT_WINDOW_S
) -> tuple[int, int]:
    """(switches, counted pairs) of the hot-prefix switch rate.

    A request counts if it has a hot prefix (bench/sim/hot_prefix.py: its longest previously seen
    prefix covers >= 50 % of its input, and an earlier routed request contained it no more than
    `window_s` before); it is then paired with the most recent such request, and the pair is a switch
    if the two went to different workers. Rejected requests (worker None) neither count nor update the
    history. `window_s=math.inf` counts every pair.
    """
    hot = HotPrefixes(window_s)
    switches = pairs = 0
    for req, worker in zip(requests, workers, strict=True):
        key = hot.hot_key(req) if worker is not None else None
        if key is not None:
            pairs += 1
            switches += key[1] != worker
        hot.record(req, worker)
    return switches, pairs


def switch_rate(
    requests: Sequence[SimRequest], workers: Sequence[str | None], window_s: float = HOT_WINDOW_S
) -> float:
    switches, pairs = switch_stats(requests, workers, window_s)
    return switches / pairs if pairs else 0.0


def coefficient_of_variation(values: Sequence[float]) -> float:
    mean = statistics.fmean(values) if values else 0.0
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


@dataclass(frozen=True, slots=True)
class LoadSeries:
    """Requests in flight per worker, sampled every `period_s` from 0 (for the load-over-time plot)."""

    period_s: float
    inflight: dict[str, list[int]]


def load_series(
    records: Sequence[RequestRecord], worker_ids: Sequence[str], samples: int = 300
) -> LoadSeries:
    """In-flight count per worker at `samples` evenly spaced instants over the run (from the records)."""
    finishes = [r.finish_s for r in records if r.finish_s is not None]
    end = max(finishes, default=0.0)
    period = end / samples if end > 0 else 1.0
    starts: dict[str, list[float]] = {w: [] for w in worker_ids}
    ends: dict[str, list[float]] = {w: [] for w in worker_ids}
    for r in records:
        if r.worker is not None and r.dispatch_s is not None:
            starts[r.worker].append(r.dispatch_s)
            ends[r.worker].append(r.finish_s if r.finish_s is not None else math.inf)
    series = {}
    for w in worker_ids:
        s, e = sorted(starts[w]), sorted(ends[w])
        series[w] = [
            bisect.bisect_right(s, k * period) - bisect.bisect_right(e, k * period) for k in range(samples)
        ]
    return LoadSeries(period, series)


def compute_metrics(
    result: SimResult, requests: Sequence[SimRequest], profile: EngineProfile
) -> dict[str, object]:
    """The results.json `metrics` object of one run (METRIC_NAMES plus a few extra keys)."""
    records = result.records
    started = [r for r in records if r.first_token_s is not None]
    done = [r for r in records if r.finish_s is not None]
    input_tokens = sum(r.input_tokens for r in started)
    ttft = sorted(r.first_token_s - r.arrival_s for r in started)  # type: ignore[operator]
    e2e = sorted(r.finish_s - r.arrival_s for r in done)  # type: ignore[operator]
    queue = sorted(_queue_delay(r, profile) for r in started)
    duration = result.duration_s
    routed_to = [r.worker for r in records]
    util = _useful_work_util(records, requests, result.worker_ids, profile, duration)
    busy = {w: (result.busy_s[w] / duration if duration > 0 else 0.0) for w in result.worker_ids}
    floor = dict(zip((r.id for r in requests), ttft_floors(requests, profile), strict=True))
    slowdown = sorted((r.first_token_s - r.arrival_s) / floor[r.id] for r in started)  # type: ignore[operator]
    flap_requests = result.extra.get("flap_requests", 0)
    return {
        "hit_rate": sum(r.cached_tokens for r in started) / input_tokens if input_tokens else 0.0,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "queue_p50": percentile(queue, 50),
        "queue_p99": percentile(queue, 99),
        "throughput_rps": len(done) / duration if duration > 0 else 0.0,
        "throughput_tok_s": sum(r.output_tokens for r in done) / duration if duration > 0 else 0.0,
        "util_cv": coefficient_of_variation(list(util.values())),
        "switch_rate": switch_rate(requests, routed_to),
        "switch_rate_all": switch_rate(requests, routed_to, math.inf),
        "flap_rate": result.extra.get("flap_moves", 0) / flap_requests if flap_requests else 0.0,
        "flap_requests": flap_requests,
        "slowdown_p50": percentile(slowdown, 50),
        "slowdown_p99": percentile(slowdown, 99),
        "ttft_mean": statistics.fmean(ttft) if ttft else math.nan,
        "inflight_cv": coefficient_of_variation(_mean_inflight(records, result.worker_ids, duration)),
        "prefill_tokens_cv": coefficient_of_variation(_prefill_tokens(records, result.worker_ids)),
        "per_worker_util": util,
        "per_worker_busy": busy,
        "requests": len(records),
        "finished": len(done),
        "rejected": sum(r.rejected for r in records),
        "duration_s": duration,
    }


def _useful_work_util(
    records: Sequence[RequestRecord],
    requests: Sequence[SimRequest],
    worker_ids: Sequence[str],
    profile: EngineProfile,
    duration: float,
) -> dict[str, float]:
    """Per worker: GPU-seconds of useful work (uncached prefill + decode tokens) per second of the run."""
    decode_token_s = decode_token_cost_s(profile, requests)
    work = dict.fromkeys(worker_ids, 0.0)
    for r in records:
        if r.worker is not None and r.first_token_s is not None:
            new_tokens = max(1, r.input_tokens - r.cached_tokens)
            work[r.worker] += prefill_time_s(profile, new_tokens, r.cached_tokens)
            work[r.worker] += r.output_tokens * decode_token_s
    return {w: (work[w] / duration if duration > 0 else 0.0) for w in worker_ids}


def _mean_inflight(
    records: Sequence[RequestRecord], worker_ids: Sequence[str], duration: float
) -> list[float]:
    """Time-averaged requests in flight per worker (dispatch to finish)."""
    busy = dict.fromkeys(worker_ids, 0.0)
    for r in records:
        if r.worker is not None and r.dispatch_s is not None and r.finish_s is not None:
            busy[r.worker] += r.finish_s - r.dispatch_s
    return [busy[w] / duration if duration > 0 else 0.0 for w in worker_ids]


def _prefill_tokens(records: Sequence[RequestRecord], worker_ids: Sequence[str]) -> list[float]:
    """Prompt tokens each worker had to compute (input minus cached)."""
    work = dict.fromkeys(worker_ids, 0.0)
    for r in records:
        if r.worker is not None and r.first_token_s is not None:
            work[r.worker] += r.input_tokens - r.cached_tokens
    return [work[w] for w in worker_ids]


def _queue_delay(record: RequestRecord, profile: EngineProfile) -> float:
    ttft = record.first_token_s - record.arrival_s  # type: ignore[operator]
    new_tokens = max(1, record.input_tokens - record.cached_tokens)
    return max(0.0, ttft - prefill_time_s(profile, new_tokens, record.cached_tokens))


BAND_NAMES: dict[Band, str] = {Band.HIGH: "high", Band.NORMAL: "normal", Band.LOW: "low"}


def is_good(record: RequestRecord, slo_ttft_s: float | None) -> bool:
    """Finished, not rejected, and its TTFT within its SLO (no SLO: finishing is enough)."""
    if record.rejected or record.finish_s is None or record.first_token_s is None:
        return False
    return slo_ttft_s is None or record.first_token_s - record.arrival_s <= slo_ttft_s


def admission_metrics(result: SimResult, requests: Sequence[SimRequest]) -> dict[str, object]:
    """`goodput` (fraction of all requests that are good, a rejected one never is), `by_priority`
    {high|normal|low: ttft_p50, ttft_p99, completed, rejected, max_wait}; max_wait = longest
    admission wait (dispatch - arrival) among the band's dispatched requests, 0 when none waited; and
    `by_tenant` {tenant: requests, rejected, goodput} (whom a gate fails: a flooding tenant or the rest)."""
    slo = {r.id: r.slo_ttft_s for r in requests}
    records = result.records
    good = sum(is_good(r, slo[r.id]) for r in records)
    by_priority: dict[str, dict[str, object]] = {}
    for band, name in BAND_NAMES.items():
        mine = [r for r in records if r.band == int(band)]
        ttft = sorted(r.first_token_s - r.arrival_s for r in mine if r.first_token_s is not None)
        waits = [r.dispatch_s - r.arrival_s for r in mine if r.dispatch_s is not None]
        by_priority[name] = {
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "completed": sum(r.finish_s is not None for r in mine),
            "rejected": sum(r.rejected for r in mine),
            "max_wait": max(waits, default=0.0),
            "requests": len(mine),
            "goodput": sum(is_good(r, slo[r.id]) for r in mine) / len(mine) if mine else None,
        }
    by_tenant: dict[str, dict[str, object]] = {}
    for tenant in sorted({r.tenant for r in records}):
        mine = [r for r in records if r.tenant == tenant]
        by_tenant[tenant] = {
            "requests": len(mine),
            "rejected": sum(r.rejected for r in mine),
            "goodput": sum(is_good(r, slo[r.id]) for r in mine) / len(mine),
        }
    return {
        "goodput": good / len(records) if records else 0.0,
        "by_priority": by_priority,
        "by_tenant": by_tenant,
    }
