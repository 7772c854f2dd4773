"""Admission gates for the simulator (`kvgate bench sim --admission`): kvgate's rules and the peers'.

Every gate implements bench/sim/cluster.py's `AdmissionGate` (admit / release / queued) plus three
hooks the runner wires in: `on_first_token` and `on_finish` (through `GatedRouter`, which forwards the
router's hooks) and `dropped` (requests that left a gate queue without running: wait budget spent;
the runner marks them rejected). Stable names:

  none           no gate: every request goes straight to a worker and queues there.
  gie_shed       GIE/llm-d legacy admission: priority < 0 (Band.LOW) rejected while saturation >= 1.
  gie_flow       GIE/llm-d flow control: strict priority bands, FCFS, dispatch while saturation < 1.
  probabilistic  llm-d probabilistic admitter: Band.LOW rejected with p = min(1, 300 * sat^5).
  kvgate         policy/admission.py's rules (quotas in seats, borrowing, fair queues, aging, limits).
  kvgate_prefill the same plus a prefill budget (PREFILL_BUDGET_PER_WORKER): a SIMULATOR-ONLY rule, the
                 gateway has no equivalent yet (docs/ADMISSION.md, "Overload settings").

Saturation (GIE/llm-d utilization detector, PEERS.md §2.1) is computed from M signals (the last scrape):
mean over workers of max(waiting / 5, kv_usage / 0.8), a worker whose scrape is older than 0.2 s
counting 1.0.
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from bench.sim.cluster import NoAdmission, Verdict
from bench.sim.profiles import EngineProfile, prefill_time_s
from bench.sim.types import ClusterView, Router, SimRequest
from policy.admission import (
    DEFAULT_AGING_MS,
    DEFAULT_MAX_SEATS,
    DEFAULT_SHARES,
    DEFAULT_TOKENS_PER_SEAT,
    SCAN,
    Usage,
    band_ok,
    clamp_seats,
    default_quota,
    effective_priority,
    estimated_wait_s,
    fair_tag,
    queue_limit,
    seat_count,
    tenant_ok,
    total_ok,
)
from policy.types import Band

SATURATION_WAITING = 5  # GIE: a pod with more than 5 waiting requests is saturated
SATURATION_KV = 0.8  # GIE: a pod above 80 % KV usage is saturated
STALE_S = 0.2  # GIE: metrics older than this count as saturated
BANDS_DOWN = (Band.HIGH, Band.NORMAL, Band.LOW)
# kvgate_prefill: pending prefill tokens per worker below which bands under HIGH are granted (1,024 per
# worker on `overload`: high TTFT p99 within 1.5x of half load with either router, docs/SIMULATOR.md)
PREFILL_BUDGET_PER_WORKER = 1024


def saturation(cluster: ClusterView, now_s: float) -> float:
    """llm-d utilization detector (roofline): mean of per-pod max(waiting / 5, kv / 0.8), stale = 1.0."""
    ids = cluster.worker_ids
    if not ids:
        return 1.0
    total = 0.0
    for wid in ids:
        s = cluster.scraped(wid)
        stale = now_s - s.at_s > STALE_S
        total += 1.0 if stale else max(s.waiting / SATURATION_WAITING, s.kv_usage / SATURATION_KV)
    return total / len(ids)


def cluster_idle(cluster: ClusterView) -> bool:
    return all(cluster.inflight(w) == 0 for w in cluster.worker_ids)


class BaseGate(NoAdmission):
    """Admit everything; no queue (cluster.NoAdmission), plus the hooks and bookkeeping every named gate
    has. Subclasses override what their rule needs."""

    name = "base"

    def __init__(self) -> None:
        self.dropped: list[int] = []  # ids that left the gate's queue without running

    def on_first_token(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        pass

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        pass


class NoGate(BaseGate):
    """`none`: no admission control; every worker queues locally (vLLM's own FCFS waiting queue)."""

    name = "none"


class GieShedGate(BaseGate):
    """`gie_shed`: GIE >= v1.0 / llm-d legacy admission (flow control off, the default):
    `priority < 0 and saturation >= 1.0` -> 429 [gateway-api-inference-extension
    pkg/epp/requestcontrol/admission.go; sheddable <=> priority < 0, pkg/epp/util/request/sheddable.go]."""

    name = "gie_shed"

    def admit(self, req: SimRequest, cluster: ClusterView, now_s: float) -> Verdict:
        if req.band == Band.LOW and saturation(cluster, now_s) >= 1.0:
            return Verdict.REJECT
        return Verdict.ADMIT


class ProbabilisticGate(BaseGate):
    """`probabilistic`: llm-d probabilistic admitter (2026): a sheddable request (priority < 0) is
    rejected with probability min(1, 300 * saturation^5) (2.3 % at 0.15, 100 % from ~0.32); others pass
    (PEERS.md §2.3)."""

    name = "probabilistic"

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def admit(self, req: SimRequest, cluster: ClusterView, now_s: float) -> Verdict:
        if req.band == Band.LOW:
            p = min(1.0, 300.0 * saturation(cluster, now_s) ** 5)
            if self.rng.random() < p:
                return Verdict.REJECT
        return Verdict.ADMIT


class GieFlowGate(BaseGate):
    """`gie_flow`: GIE / llm-d flow control (feature gate `flowControl`, PEERS.md §2.2;
    pkg/epp/flowcontrol/controller/internal/processor.go): one queue per priority band, FCFS inside a
    band (global-strict fairness, the default), strict priority between bands; a tick runs at each
    arrival and every 1 ms and dispatches at most one request, the head of the highest non-empty band,
    while saturation < 1.0 (static ceiling), so lower bands wait too. The simulator calls the gate at
    arrivals, finishes and scrapes, so a call dispatches up to one request per millisecond elapsed since
    the last tick. A full band (5,000 requests by default) rejects; no TTL by default. With nothing in
    flight at all it fails open (dispatches the head)."""

    name = "gie_flow"
    TICK_S = 0.001

    def __init__(self, queue_max: int = 5000) -> None:
        super().__init__()
        self.queue_max = queue_max
        self.queues: dict[Band, deque[SimRequest]] = {b: deque() for b in BANDS_DOWN}
        self.last_tick_s = 0.0

    def admit(self, req: SimRequest, cluster: ClusterView, now_s: float) -> Verdict:
        if len(self.queues[req.band]) >= self.queue_max:
            return Verdict.REJECT
        if self.queued() == 0 and saturation(cluster, now_s) < 1.0:  # this arrival's tick dispatches it
            self.last_tick_s = now_s
            return Verdict.ADMIT
        self.queues[req.band].append(req)  # the next call's ticks dispatch it, highest band first
        return Verdict.QUEUE

    def release(self, cluster: ClusterView, now_s: float) -> Sequence[SimRequest]:
        ticks = max(1, int((now_s - self.last_tick_s) / self.TICK_S + 1e-9))
        self.last_tick_s = now_s
        out: list[SimRequest] = []
        # the saturation signal is a scrape: it does not move during the ticks of one call
        if self.queued() and (saturation(cluster, now_s) < 1.0 or cluster_idle(cluster)):
            for _ in range(ticks):
                band = next((b for b in BANDS_DOWN if self.queues[b]), None)
                if band is None:
                    break
                out.append(self.queues[band].popleft())
        return out

    def queued(self) -> int:
        return sum(len(q) for q in self.queues.values())


@dataclass(frozen=True, slots=True)
class KvgateConfig:
    """Knobs of the kvgate gate (defaults are what `--admission kvgate` runs)."""

    # policy/admission.py's defaults, as an operator gets them: 4096-token seats, at most 16 per request,
    # default_quota's shares (high 0.5, normal 0.3, low 0.2; high and normal borrow, low does not).
    # Measured on `overload` (docs/SIMULATOR.md, "Gate settings"): the settings tuned on the earlier
    # W-calibrated scenario (512-token seats, up to 64, shares 0.2/0.6/0.2) gain 3-4 points of goodput
    # and lengthen the high band's TTFT p99 2-3x; 512-token seats are no gateway setting.
    tokens_per_seat: int = DEFAULT_TOKENS_PER_SEAT
    max_seats: int = DEFAULT_MAX_SEATS
    seats_per_worker: int | None = None  # None: the worker's KV capacity in seats
    shares: Mapping[Band, float] = field(default_factory=lambda: dict(DEFAULT_SHARES))
    aging_ms: int = DEFAULT_AGING_MS
    # wait budget when the request has no SLO, and the "acceptable wait" of the queue-length rule
    wait_s: Mapping[Band, float] = field(
        default_factory=lambda: {Band.HIGH: 2.0, Band.NORMAL: 10.0, Band.LOW: 60.0}
    )
    qps_window_s: float = 10.0  # expected QPS per band = arrivals in the last window / window
    slo_reject: bool = True  # Mooncake-style early rejection on the predicted TTFT
    # sustained pressure: a band above LOW has had waiters for this long -> new LOW requests are refused
    shed_low_after_s: float | None = 1.0
    # second step, prefill headroom: a band below HIGH is granted only while the cluster's pending
    # prefill tokens (R) stay under this, so an online request finds a worker not busy prefilling
    prefill_budget_tokens: int | None = None


@dataclass(slots=True)
class _Waiter:
    req: SimRequest
    seats: int
    tag: int
    deadline_ms: int


class KvgateGate(BaseGate):
    """`kvgate`: policy/admission.py's rules (the Lua scripts' twin), driven incrementally.

    - Global quota in seats from capacity: `default_quota(workers, seats_per_worker, shares)`, where a
      seat is `tokens_per_seat` KV tokens and a worker holds `capacity_tokens // tokens_per_seat`
      seats; a request takes `seat_count(uncached prompt on the best worker, max_tokens)` seats, clamped.
    - Per-band nominal shares; high and normal borrow what lower bands leave unused, low cannot
      (`band_ok`): under pressure the batch band is held to its share and is shed first (its queue
      fills and its wait budget runs out before an online request's).
    - One queue per band ordered by the fair tag (`fair_tag`: a flooding tenant interleaves with the
      others), strict priority between bands with aging (`effective_priority`, ties to the band served
      longest ago), first grantable among the first SCAN; a head that does not fit the total blocks.
    - Queue length per band: `queue_limit(expected QPS, acceptable wait)`, QPS measured over a window.
    - Wait budget: the request's TTFT SLO (else the band's wait); an expired waiter leaves (rejected).
    - SLO-aware early rejection (Mooncake, PEERS.md §2.4): refuse at the door when the predicted TTFT on
      the best worker (its pending prefill + this prompt, + `estimated_wait_s` when queued) exceeds the SLO,
      and at grant time when the wait so far + the predicted TTFT from now does (the waiter leaves, 429).
    The state here is incremental (sorted queues, running usage) but applies the same pure functions as
    `policy.admission.AdmissionState`, whose per-call rescans are too slow for 10^4-request runs."""

    name = "kvgate"

    def __init__(
        self, profile: EngineProfile, workers: int, config: KvgateConfig | None = None, name: str = "kvgate"
    ) -> None:
        super().__init__()
        self.name = name
        self.profile = profile
        self.config = cfg = config or KvgateConfig()
        per_worker = cfg.seats_per_worker or max(1, profile.capacity_tokens // max(1, cfg.tokens_per_seat))
        self.quota = replace(default_quota(workers, per_worker, cfg.shares), aging_ms=cfg.aging_ms)
        self.capacity_seats = self.quota.total or 1
        self.leases: dict[int, tuple[int, Band, str, int]] = {}  # id -> seats, band, tenant, granted_ms
        self.used_total = 0
        self.used_band: dict[Band, int] = dict.fromkeys(Band, 0)
        self.used_tenant: dict[str, int] = {}
        self.queues: dict[Band, list[tuple[int, int]]] = {b: [] for b in Band}  # sorted (tag, id)
        self.waiters: dict[int, _Waiter] = {}
        self.deadlines: list[tuple[int, int]] = []  # heap (deadline_ms, id)
        self.vtime: dict[Band, int] = dict.fromkeys(Band, 0)
        self.since: dict[Band, int] = {}
        self.tags: dict[Band, dict[str, int]] = {b: {} for b in Band}
        self.hold_s = 0.0  # moving average of lease hold times
        self.arrivals: dict[Band, deque[float]] = {b: deque() for b in Band}
        self.ready: list[SimRequest] = []  # granted, not yet dispatched
        self.ready_tokens = 0  # their prompt tokens: pending prefill the cluster does not see yet
        self.pressure_since_ms: int | None = None  # since when a band above LOW has had waiters
        self.cluster: ClusterView | None = None  # the cluster last seen (the same object every call)

    @property
    def release_on_first_token(self) -> bool:
        """A prefill budget frees at first tokens: the loop must offer the gate a release then too."""
        return self.config.prefill_budget_tokens is not None

    # ---- AdmissionGate ----------------------------------------------------------------------------

    def admit(self, req: SimRequest, cluster: ClusterView, now_s: float) -> Verdict:
        self.cluster = cluster
        now_ms = _ms(now_s)
        self._reap(now_ms)
        self._pump(now_ms)
        band, cfg = req.band, self.config
        budget_s = req.slo_ttft_s if req.slo_ttft_s is not None else cfg.wait_s[band]
        uncached, engine_ttft = self._best_worker(req, cluster)
        seats = clamp_seats(
            seat_count(uncached, req.output_tokens, cfg.tokens_per_seat, cfg.max_seats),
            self.quota,
            band,
            req.tenant,
        )
        if cfg.slo_reject and req.slo_ttft_s is not None and engine_ttft > req.slo_ttft_s:
            return Verdict.REJECT
        if band == Band.LOW and self._sustained_pressure(now_ms):
            return Verdict.REJECT  # shed batch traffic first
        queue = self.queues[band]
        was_empty = not queue
        prev_tag = self.tags[band].get(req.tenant)
        tag = fair_tag(self.vtime[band], prev_tag, seats)
        insort(queue, (tag, req.id))
        self.tags[band][req.tenant] = tag
        self.waiters[req.id] = _Waiter(req, seats, tag, now_ms + _ms(budget_s))
        if was_empty:
            self.since[band] = now_ms
        if req.id in self._pump(now_ms):
            self.ready.remove(req)
            self.ready_tokens -= req.input_tokens
            return Verdict.ADMIT
        ahead = bisect_left(queue, (tag, req.id)) + sum(len(self.queues[b]) for b in Band if b > band)
        wait = estimated_wait_s(ahead, self.capacity_seats, self.hold_s)
        full = len(queue) - 1 >= self._queue_limit(band, now_s)
        late = cfg.slo_reject and req.slo_ttft_s is not None and wait + engine_ttft > req.slo_ttft_s
        if full or late:
            self._leave(req.id)
            if queue:  # restore the tenant's tag: the refused request never took a turn
                if prev_tag is None:
                    self.tags[band].pop(req.tenant, None)
                else:
                    self.tags[band][req.tenant] = prev_tag
            return Verdict.REJECT
        heapq.heappush(self.deadlines, (now_ms + _ms(budget_s), req.id))
        return Verdict.QUEUE

    def release(self, cluster: ClusterView, now_s: float) -> Sequence[SimRequest]:
        self.cluster = cluster
        now_ms = _ms(now_s)
        self._reap(now_ms)
        self._pump(now_ms)
        out, self.ready, self.ready_tokens = self.ready, [], 0
        return out

    def queued(self) -> int:
        return len(self.waiters) + len(self.ready)

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        lease = self.leases.pop(req.id, None)
        if lease is None:
            return
        seats, band, tenant, granted_ms = lease
        self.used_total -= seats
        self.used_band[band] -= seats
        self.used_tenant[tenant] -= seats
        held_s = now_s - granted_ms / 1000
        self.hold_s = held_s if self.hold_s <= 0 else 0.9 * self.hold_s + 0.1 * held_s
        now_ms = _ms(now_s)
        self._reap(now_ms)
        self._pump(now_ms)

    # ---- rules ------------------------------------------------------------------------------------

    def _best_worker(self, req: SimRequest, cluster: ClusterView) -> tuple[int, float]:
        """(uncached prompt tokens, predicted engine TTFT) on the worker where the TTFT is lowest:
        its pending prefill at one chunk per step, then this prompt's uncached part (Mooncake's
        queue time + prefill time)."""
        best: tuple[int, float] | None = None
        blocks = req.block_tokens
        chunk = self.profile.max_num_batched_tokens
        chunk_s = prefill_time_s(self.profile, chunk, 0)
        for wid in cluster.worker_ids:
            cached = sum(blocks[: cluster.cached_prefix_blocks(wid, req)])
            uncached = req.input_tokens - cached
            # prompts ahead are separate requests: chunked prefill clears them at one chunk per step
            ahead_s = cluster.pending_prefill_tokens(wid) / chunk * chunk_s
            ttft = ahead_s + prefill_time_s(self.profile, max(1, uncached), cached)
            if best is None or ttft < best[1]:
                best = (uncached, ttft)
        return best or (req.input_tokens, 0.0)

    def _queue_limit(self, band: Band, now_s: float) -> int:
        window = self.arrivals[band]
        window.append(now_s)
        while window and window[0] < now_s - self.config.qps_window_s:
            window.popleft()
        return queue_limit(len(window) / self.config.qps_window_s, self.config.wait_s[band])

    def _sustained_pressure(self, now_ms: int) -> bool:
        limit = self.config.shed_low_after_s
        since = self.pressure_since_ms
        return limit is not None and since is not None and now_ms - since >= _ms(limit)

    def _track_pressure(self, now_ms: int) -> None:
        waiting_above_low = any(self.queues[b] for b in Band if b > Band.LOW)
        if not waiting_above_low:
            self.pressure_since_ms = None
        elif self.pressure_since_ms is None:
            self.pressure_since_ms = now_ms

    def _prefill_headroom(self) -> bool:
        budget, cluster = self.config.prefill_budget_tokens, self.cluster
        if budget is None or cluster is None:
            return True
        # granted requests join the cluster's pending prefill only when dispatched, after this pump
        pending = self.ready_tokens + sum(cluster.pending_prefill_tokens(w) for w in cluster.worker_ids)
        return pending < budget

    def _usage(self) -> Usage:
        return Usage(self.used_total, self.used_band, self.used_tenant)

    def _pump(self, now_ms: int) -> list[int]:
        """Grant waiters while the best band's offer fits (AdmissionState._pump, incrementally)."""
        granted: list[int] = []
        while True:
            usage = self._usage()
            best: tuple[int, int, int] | None = None  # id, effective priority, since
            headroom = self._prefill_headroom()
            for band in BANDS_DOWN:
                if band < Band.HIGH and not headroom:
                    continue
                for _, rid in self.queues[band][:SCAN]:
                    w = self.waiters[rid]
                    if tenant_ok(self.quota, usage, w.req.tenant, w.seats) and band_ok(
                        self.quota, usage, band, w.seats
                    ):
                        since = self.since.get(band, now_ms)
                        eff = effective_priority(band, since, now_ms, self.quota.aging_ms)
                        if best is None or eff > best[1] or (eff == best[1] and since < best[2]):
                            best = (rid, eff, since)
                        break
            if best is None or not total_ok(self.quota, usage, self.waiters[best[0]].seats):
                self._track_pressure(now_ms)
                return granted
            if self._too_late(self.waiters[best[0]].req, now_ms):
                self._leave(best[0])  # its seats would buy a late answer: 429 now, seats to the next
                self.dropped.append(best[0])
                continue
            self._grant(now_ms, best[0])
            granted.append(best[0])

    def _too_late(self, req: SimRequest, now_ms: int) -> bool:
        """SLO-aware rejection at grant time: the predicted TTFT from now misses the request's SLO."""
        if not self.config.slo_reject or req.slo_ttft_s is None or self.cluster is None:
            return False
        ttft_s = self._best_worker(req, self.cluster)[1]
        return now_ms + _ms(ttft_s) > _ms(req.arrival_s + req.slo_ttft_s)

    def _grant(self, now_ms: int, rid: int) -> None:
        w = self.waiters[rid]
        band, tenant = w.req.band, w.req.tenant
        self._leave(rid)
        self.leases[rid] = (w.seats, band, tenant, now_ms)
        self.used_total += w.seats
        self.used_band[band] += w.seats
        self.used_tenant[tenant] = self.used_tenant.get(tenant, 0) + w.seats
        self.vtime[band] = w.tag
        self.since[band] = now_ms
        self.ready.append(w.req)
        self.ready_tokens += w.req.input_tokens

    def _leave(self, rid: int) -> None:
        w = self.waiters.pop(rid)
        queue = self.queues[w.req.band]
        del queue[bisect_left(queue, (w.tag, rid))]
        if not queue:
            self.tags[w.req.band].clear()

    def _reap(self, now_ms: int) -> None:
        while self.deadlines and self.deadlines[0][0] <= now_ms:
            _, rid = heapq.heappop(self.deadlines)
            if rid in self.waiters:
                self._leave(rid)
                self.dropped.append(rid)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


class GatedRouter:
    """A Router that forwards its hooks to the gate too (the gate learns which requests ended)."""

    def __init__(self, inner: Router, gate: BaseGate) -> None:
        self.inner = inner
        self.gate = gate
        self.name = inner.name

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        return self.inner.route(req, cluster, now_s)

    def on_first_token(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        self.inner.on_first_token(req, worker_id, now_s)
        self.gate.on_first_token(req, worker_id, now_s)

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        self.inner.on_finish(req, worker_id, now_s)
        self.gate.on_finish(req, worker_id, now_s)


GateFactory = Callable[[EngineProfile, int, int], BaseGate]  # (profile, workers, seed) -> gate


GATES: dict[str, GateFactory] = {
    "none": lambda profile, workers, seed: NoGate(),
    "gie_shed": lambda profile, workers, seed: GieShedGate(),
    "gie_flow": lambda profile, workers, seed: GieFlowGate(),
    "probabilistic": lambda profile, workers, seed: ProbabilisticGate(seed),
    "kvgate": lambda profile, workers, seed: KvgateGate(profile, workers),
    "kvgate_prefill": lambda profile, workers, seed: KvgateGate(
        profile,
        workers,
        KvgateConfig(prefill_budget_tokens=workers * PREFILL_BUDGET_PER_WORKER),
        name="kvgate_prefill",
    ),
}


class UnknownAdmission(ValueError):
    pass


def resolve_admissions(spec: str) -> list[str]:
    """`all` or a comma-separated list of gate names, checked."""
    if spec.strip() == "all":
        return list(GATES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise UnknownAdmission("no admission policy given")
    for name in names:
        if name not in GATES:
            raise UnknownAdmission(f"unknown admission policy {name!r}; known: {', '.join(GATES)}")
    return list(dict.fromkeys(names))


def make_gate(name: str, profile: EngineProfile, workers: int, seed: int) -> BaseGate:
    if name not in GATES:
        raise UnknownAdmission(f"unknown admission policy {name!r}; known: {', '.join(GATES)}")
    return GATES[name](profile, workers, seed)
