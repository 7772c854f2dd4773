"""The simulator's discrete-event loop: requests arrive, a Router picks a worker, engines run in virtual time.

Events sit in one heap keyed by `(time_s, phase, seq)`; at equal times the phase decides:
  ENGINE  (0) an engine's next first-token/finish: the router's R counters drop before anything else at t;
  SCRAPE  (1) metrics snapshot at a period boundary k * scrape_period_s: sees the engines after their events;
  ARRIVAL (2) a request arrives: sees the scrape taken at the same instant;
and `seq` (creation order) breaks the remaining ties, so a run is fully deterministic.
Before the loop handles an arrival or a scrape at time t it advances every engine to t; the events the
engines produced up to t enter the heap (phase ENGINE, at their own times <= t) and are handled first,
in time order, ties in registry order. Routers only act at arrivals, so this equals stepping engine by
engine through each event, at a fraction of the cost (no look-ahead per event). Scrapes are taken only
at the boundaries that precede an arrival (the last boundary <= the arrival), the only ones a router can
read; the snapshot equals what a scrape every period would have seen at that boundary.
The optional `AdmissionGate` sees each arrival first (admit, reject, or hold in its own queue and release
later, after finishes); the default admits everything. Per-request timestamps go into one flat
`RequestRecord` each; bench/sim/metrics.py turns them into the report.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, cast

from bench.sim.engine import Engine, EngineRequest, Finished, FirstToken
from bench.sim.hot_prefix import FlapCounter
from bench.sim.profiles import EngineProfile
from bench.sim.types import ClusterView, RefusedAtDoor, Router, Scraped, SimRequest
from policy.types import WorkerView

PHASE_ENGINE = 0
PHASE_SCRAPE = 1
PHASE_ARRIVAL = 2

EventKey = tuple[float, int, int]  # (time_s, phase, seq)


def event_key(time_s: float, phase: int, seq: int) -> EventKey:
    """The heap order of simulator events (see module docstring)."""
    return (time_s, phase, seq)


class Verdict(Enum):
    ADMIT = "admit"  # dispatch now
    REJECT = "reject"  # answered 429: never runs
    QUEUE = "queue"  # held by the gate; returned later by `release`


class AdmissionGate(Protocol):
    """Admission in front of routing. Extension point for the overload scenario (bands, tenants, SLOs)."""

    def admit(self, req: SimRequest, cluster: ClusterView, now_s: float) -> Verdict: ...

    def release(self, cluster: ClusterView, now_s: float) -> Sequence[SimRequest]:
        """Queued requests to dispatch now; called after finishes (and after first tokens when the gate
        has a true `release_on_first_token` attribute: a gate that limits pending prefill)."""
        ...

    def queued(self) -> int:
        """Requests held; while > 0 the loop keeps scrape ticks going so releases are not starved."""
        ...


class NoAdmission:
    """Admit everything (the default): routing is measured alone."""

    release_on_first_token = False

    def admit(self, req: SimRequest, cluster: ClusterView, now_s: float) -> Verdict:
        return Verdict.ADMIT

    def release(self, cluster: ClusterView, now_s: float) -> Sequence[SimRequest]:
        return ()

    def queued(self) -> int:
        return 0


@dataclass(slots=True)
class RequestRecord:
    """Everything that happened to one request (times in virtual seconds; None = did not happen)."""

    id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    band: int
    tenant: str
    worker: str | None = None
    dispatch_s: float | None = None  # admitted and submitted to the engine
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    rejected: bool = False


@dataclass(slots=True)
class SimResult:
    """What one simulated run produced, before metrics."""

    policy: str
    records: list[RequestRecord]
    worker_ids: list[str]
    busy_s: dict[str, float]
    prefix_cache_queries: dict[str, int]
    prefix_cache_hits: dict[str, int]
    duration_s: float  # first arrival (0) to last finish
    scrapes: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def engine_blocks(req: SimRequest) -> tuple[tuple[int, int], ...]:
    return tuple(zip(req.block_ids, req.block_tokens, strict=True))


class SimCluster:
    """The workers and the signals routers may read (implements `ClusterView`)."""

    def __init__(self, profile: EngineProfile, workers: int, record_kv_events: bool = False) -> None:
        if workers <= 0:
            raise ValueError(f"workers must be > 0, got {workers}")
        self.profile = profile
        self._ids = [f"w{i}" for i in range(workers)]
        self.engines = {wid: Engine(profile, record_kv_events=record_kv_events) for wid in self._ids}
        self._inflight = dict.fromkeys(self._ids, 0)
        self._pending_prefill = dict.fromkeys(self._ids, 0)
        self._scraped = {wid: Scraped(0.0, 0, 0, 0.0) for wid in self._ids}
        self._blocks_for: tuple[int, tuple[tuple[int, int], ...]] = (-1, ())

    # ClusterView
    @property
    def worker_ids(self) -> Sequence[str]:
        return self._ids

    def inflight(self, worker_id: str) -> int:
        return self._inflight[worker_id]

    def pending_prefill_tokens(self, worker_id: str) -> int:
        return self._pending_prefill[worker_id]

    def scraped(self, worker_id: str) -> Scraped:
        return self._scraped[worker_id]

    def cached_prefix_blocks(self, worker_id: str, req: SimRequest) -> int:
        return self.engines[worker_id].cached_prefix_blocks(self.blocks_of(req))

    def capacity_tokens(self, worker_id: str) -> int:
        return self.profile.capacity_tokens

    def queued_prefill_tokens(self, worker_id: str) -> int:
        """Engine truth (for flap_rate, not for routers): prompt tokens still to compute there."""
        return self.engines[worker_id].queued_prefill_tokens()

    def max_concurrency(self, worker_id: str) -> int:
        return self.profile.max_num_seqs

    def worker_views(self, now_s: float) -> list[WorkerView]:
        views = []
        for wid in self._ids:
            scraped = self._scraped[wid]
            views.append(
                WorkerView(
                    id=wid,
                    inflight=self._inflight[wid],
                    running=scraped.running,
                    waiting=scraped.waiting,
                    kv_usage=scraped.kv_usage,
                    pending_prefill_tokens=self._pending_prefill[wid],
                    capacity_tokens=self.profile.capacity_tokens,
                    max_concurrency=self.profile.max_num_seqs,
                    joined_s=0.0,
                )
            )
        return views

    def drain_kv_events(self, worker_id: str) -> list[tuple[str, list[object]]]:
        return self.engines[worker_id].drain_kv_events()

    # shell side
    def blocks_of(self, req: SimRequest) -> tuple[tuple[int, int], ...]:
        """Engine blocks of `req`, memoised for the request being routed (routers ask once per worker)."""
        if self._blocks_for[0] != req.id:
            self._blocks_for = (req.id, engine_blocks(req))
        return self._blocks_for[1]

    def scrape(self, at_s: float) -> None:
        for wid, engine in self.engines.items():
            self._scraped[wid] = Scraped(at_s, engine.running, engine.waiting, engine.kv_usage)

    def on_dispatch(self, wid: str, req: SimRequest) -> None:
        self._inflight[wid] += 1
        self._pending_prefill[wid] += req.input_tokens

    def on_first_token(self, wid: str, req: SimRequest) -> None:
        self._pending_prefill[wid] -= req.input_tokens

    def on_finish(self, wid: str) -> None:
        self._inflight[wid] -= 1


ProgressFn = Callable[[int, int], None]  # (arrivals handled, total)


def simulate(
    requests: Sequence[SimRequest],
    router: Router,
    profile: EngineProfile,
    workers: int,
    *,
    scrape_period_s: float = 0.05,
    gate: AdmissionGate | None = None,
    progress: ProgressFn | None = None,
    every_scrape: bool = False,
) -> SimResult:
    """Replay `requests` (sorted by arrival) through `router` onto `workers` engines of `profile`.

    `every_scrape` takes a scrape at every period boundary instead of only those before arrivals
    (reference mode for tests: results must be identical, only slower)."""
    if scrape_period_s <= 0:
        raise ValueError(f"scrape_period_s must be > 0, got {scrape_period_s}")
    run = _Run(requests, router, profile, workers, scrape_period_s, gate or NoAdmission(), progress)
    return run.run(every_scrape)


class _Run:
    """One simulation: the heap, the cluster, the records. Used once by `simulate`."""

    def __init__(
        self,
        requests: Sequence[SimRequest],
        router: Router,
        profile: EngineProfile,
        workers: int,
        scrape_period_s: float,
        gate: AdmissionGate,
        progress: ProgressFn | None,
    ) -> None:
        self.requests = requests
        self.router = router
        self.cluster = SimCluster(profile, workers, bool(getattr(router, "wants_kv_events", False)))
        self.period = scrape_period_s
        self.gate = gate
        self.progress = progress
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.records = {
            r.id: RequestRecord(r.id, r.arrival_s, r.input_tokens, r.output_tokens, int(r.band), r.tenant)
            for r in requests
        }
        if len(self.records) != len(requests):
            raise ValueError("request ids must be unique")
        self.by_id = {r.id: r for r in requests}
        self.scrapes = 0
        self.now = 0.0
        self.engines_at = -math.inf  # every engine has been advanced to this time
        self.finished_since_release = False
        self.release_on_first_token = bool(getattr(gate, "release_on_first_token", False))
        self.scrape_boundaries: set[int] = set()
        self.flaps = FlapCounter(profile)

    def push(self, time_s: float, phase: int, payload: object) -> None:
        heapq.heappush(self.heap, (time_s, phase, self.seq, payload))
        self.seq += 1

    def push_scrape(self, k: int) -> None:
        if k not in self.scrape_boundaries:
            self.scrape_boundaries.add(k)
            self.push(k * self.period, PHASE_SCRAPE, k)

    def run(self, every_scrape: bool = False) -> SimResult:
        last_boundary = -1
        for req in self.requests:
            boundary = math.floor(req.arrival_s / self.period)
            first = last_boundary + 1 if every_scrape else boundary
            for k in range(max(first, last_boundary + 1), boundary + 1):
                self.push_scrape(k)
            last_boundary = max(last_boundary, boundary)
            self.push(req.arrival_s, PHASE_ARRIVAL, req)
        total = len(self.requests)
        step = max(1, total // 100)
        arrived = 0
        while self.heap:
            now, phase, _, payload = self.heap[0]
            if phase != PHASE_ENGINE and now > self.engines_at:
                # bring every engine to this instant; its events (all <= now) enter the heap ahead of it
                self.collect(now)
                continue
            heapq.heappop(self.heap)
            self.now = now
            if phase == PHASE_ENGINE:
                wid, event = cast(tuple[str, FirstToken | Finished], payload)
                self.deliver(wid, event)
            elif phase == PHASE_SCRAPE:
                self.cluster.scrape(now)
                self.scrapes += 1
                if self.gate.queued():  # keep ticking while the gate holds requests
                    self.push_scrape(payload + 1)  # type: ignore[operator]
            else:
                assert isinstance(payload, SimRequest)
                self.arrive(payload, now)
                arrived += 1
                if self.progress is not None and (arrived % step == 0 or arrived == total):
                    self.progress(arrived, total)
            self.release_queued()
            if not self.heap:
                if self.gate.queued():
                    self.push_scrape(math.floor(now / self.period) + 1)
                else:
                    self.collect(math.inf)  # drain: run every engine to completion
        return self.result()

    def collect(self, until_s: float) -> None:
        """Advance all engines to `until_s` and queue their events (ties: registry order)."""
        for wid, engine in self.cluster.engines.items():
            for event in engine.advance(until_s):
                self.push(event.at_s, PHASE_ENGINE, (wid, event))
        self.engines_at = until_s

    def arrive(self, req: SimRequest, now: float) -> None:
        for wid in req.restart_before:  # a restart: running requests start over, the prefix cache is gone
            self.cluster.engines[wid].restart(now)
        if req.bypass:  # a client that talks to a worker directly: no gate, no router
            ids = self.cluster.worker_ids
            self.submit(req, ids[zlib.crc32(req.tenant.encode()) % len(ids)], now, routed=False)
            return
        verdict = self.gate.admit(req, self.cluster, now)
        if verdict is Verdict.ADMIT:
            self.dispatch(req, now)
        elif verdict is Verdict.REJECT:
            self.reject(req)

    def reject(self, req: SimRequest) -> None:
        self.records[req.id].rejected = True
        self.flaps.reject(req)

    def dispatch(self, req: SimRequest, now: float) -> None:
        try:
            wid = self.router.route(req, self.cluster, now)
        except RefusedAtDoor:  # the engine-queue guard on the routing decision (kvgate_guard)
            self.reject(req)
            return
        self.submit(req, wid, now)

    def submit(self, req: SimRequest, wid: str, now: float, *, routed: bool = True) -> None:
        engine = self.cluster.engines.get(wid)
        if engine is None:
            raise ValueError(f"router {self.router.name!r} picked unknown worker {wid!r}")
        if routed:
            self.flaps.observe(req, wid, self.cluster.worker_ids, self.cluster)
        else:  # not the router's decision: no flap to count, but its prefix was asked for
            self.flaps.bypass(req, wid)
        record = self.records[req.id]
        record.worker = wid
        record.dispatch_s = now
        self.cluster.on_dispatch(wid, req)
        engine.submit(EngineRequest(req.id, self.cluster.blocks_of(req), req.output_tokens), now)

    def deliver(self, wid: str, event: FirstToken | Finished) -> None:
        req = self.by_id[event.id]  # type: ignore[index]
        record = self.records[req.id]
        if isinstance(event, FirstToken):
            record.first_token_s = event.at_s
            record.cached_tokens = event.cached_tokens
            self.cluster.on_first_token(wid, req)
            if not req.bypass:
                self.router.on_first_token(req, wid, event.at_s)
            self.finished_since_release |= self.release_on_first_token  # its prefill left the queue
        else:
            record.finish_s = event.at_s
            self.cluster.on_finish(wid)
            if not req.bypass:  # the usage (cached tokens) comes with the response's end
                self.router.on_usage(req, wid, record.cached_tokens, event.at_s)
                self.router.on_finish(req, wid, event.at_s)
            self.finished_since_release = True

    def release_queued(self) -> None:
        """After finishes, the gate may release held requests; they dispatch at the engines' time, the
        latest instant every engine has reached (submits cannot go back in time)."""
        if not self.finished_since_release:
            return
        self.finished_since_release = False
        at = self.engines_at if self.engines_at != math.inf else self.now
        for queued in self.gate.release(self.cluster, at):
            self.dispatch(queued, at)

    def result(self) -> SimResult:
        engines = self.cluster.engines
        records = [self.records[r.id] for r in self.requests]
        finishes = [r.finish_s for r in records if r.finish_s is not None]
        return SimResult(
            policy=self.router.name,
            records=records,
            worker_ids=list(self.cluster.worker_ids),
            busy_s={wid: e.busy_s for wid, e in engines.items()},
            prefix_cache_queries={wid: e.prefix_cache_queries for wid, e in engines.items()},
            prefix_cache_hits={wid: e.prefix_cache_hits for wid, e in engines.items()},
            duration_s=max(finishes, default=0.0),
            scrapes=self.scrapes,
            extra={"flap_requests": self.flaps.requests, "flap_moves": self.flaps.flaps},
        )
