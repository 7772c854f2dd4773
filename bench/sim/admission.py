"""Admission gates for the simulator (`kvgate bench sim --admission`): kvgate's rules and the peers'.

Every gate implements bench/sim/cluster.py's `AdmissionGate` (admit / release / queued) plus three
hooks the runner wires in: `on_first_token` and `on_finish` (through `GatedRouter`, which forwards the
router's hooks) and `dropped` (requests that left a gate queue without running: wait budget spent;
the runner marks them rejected). Stable names:

  none           no gate: every request goes straight to a worker and queues there.
  gie_shed       GIE/llm-d legacy admission: priority < 0 (Band.LOW) rejected while saturation >= 1.
  gie_flow       GIE/llm-d flow control: strict priority bands, FCFS, dispatch while saturation < 1.
  probabilistic  llm-d probabilistic admitter: Band.LOW rejected with p = min(1, 300 * sat^5).
  kvgate_guard   the gateway without a quota: only the engine-queue guard at the door, on the routing
                 decision (policy/admission.py door_wait_s + queue_too_deep, `[admission] max_queue_ms`
                 and `queue_signal` at their measured setting).
  kvgate         policy/admission.py's AdmissionState, the Lua scripts' twin (quotas in seats, borrowing,
                 fair queues, aging, limits), plus the simulator's hooks (docs/ADMISSION.md, "Hooks").
  kvgate_prefill the same plus a prefill budget (PREFILL_BUDGET_PER_WORKER): a SIMULATOR-ONLY hook, the
                 gateway has no equivalent yet (docs/ADMISSION.md, "Overload settings").

Saturation (GIE/llm-d utilization detector, PEERS.md §2.1) is computed from M signals (the last scrape):
mean over workers of max(waiting / 5, kv_usage / 0.8), a worker whose scrape is older than 0.2 s
counting 1.0.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from bench.sim.cluster import NoAdmission, Verdict
from bench.sim.policy_router import PolicyRouter
from bench.sim.profiles import EngineProfile, prefill_time_s
from bench.sim.types import ClusterView, Router, SimRequest
from policy.admission import (
    DEFAULT_AGING_MS,
    DEFAULT_MAX_QUEUE_MS,
    DEFAULT_MAX_SEATS,
    DEFAULT_QUEUE_SIGNAL,
    DEFAULT_SHARES,
    DEFAULT_TOKENS_PER_SEAT,
    AdmissionHooks,
    AdmissionState,
    AdmitCode,
    Quota,
    default_quota,
    door_wait_s,
    queue_limit,
    queue_too_deep,
    seat_count,
)
from policy.pressure import PressureTracker
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


class QueueGuardGate(BaseGate):
    """`kvgate_guard`: what the gateway runs when no quota applies (no `total`, workers of unknown
    `max_concurrency`, as in `kvgate bench live`): no seats and no queue, only the engine-queue guard at
    the door with the gateway's rule, on the routing decision as the gateway reads it
    (`policy.admission.door_wait_s` of the chosen worker's scores, `queue_too_deep`; plugin/placement.py),
    at `[admission]`'s default budget and signal unless given. It admits every request to routing; the
    kvgate policies' router (bench/sim/policy_router.py) asks `refuses` after its decision and before
    its commit (GatedRouter wires it). Routers that predict no wait (the peers, round_robin) are never
    refused, as at the gateway."""

    name = "kvgate_guard"

    def __init__(
        self,
        profile: EngineProfile,
        max_queue_s: float = DEFAULT_MAX_QUEUE_MS / 1000,
        queue_signal: str = DEFAULT_QUEUE_SIGNAL,
    ) -> None:
        super().__init__()
        self.profile = profile
        self.max_queue_s = max_queue_s
        self.queue_signal = queue_signal

    def refuses(self, band: Band, chosen_scores: Mapping[str, float]) -> bool:
        wait_s = door_wait_s(chosen_scores, self.queue_signal)
        return wait_s is not None and queue_too_deep(band, wait_s, self.max_queue_s)


@dataclass(frozen=True, slots=True)
class KvgateConfig:
    """Knobs of the kvgate gate (defaults are what `--admission kvgate` runs). The last four switch the
    simulator's own rules (docs/ADMISSION.md, "Hooks"): `qps_window_s = 0`, `slo_reject = False`,
    `shed_low_after_s = None`, `prefill_budget_tokens = None` turn them off, and the gate then grants
    exactly what `AdmissionState` grants (tests/property/test_sim_gate_agrees.py)."""

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
    # wait budget per band when the request has no SLO, and the "acceptable wait" of the queue-length rule
    wait_s: Mapping[Band, float] = field(
        default_factory=lambda: {Band.HIGH: 2.0, Band.NORMAL: 10.0, Band.LOW: 60.0}
    )
    # queue length per band from its measured arrival rate: queue_limit(arrivals in the last window /
    # window, wait_s[band]) becomes the quota's queue_max:<b> before each acquire; 0 = the quota's own
    qps_window_s: float = 10.0
    slo_reject: bool = True  # Mooncake-style early rejection on the predicted TTFT (door, queue, grant)
    # sustained pressure (policy/pressure.py): a band above LOW has had waiters this long -> new LOW
    # requests are refused at the door (the gateway's `shed_low_after_ms`)
    shed_low_after_s: float | None = 1.0
    # second step, prefill headroom: a band below HIGH is granted only while the cluster's pending
    # prefill tokens (R) stay under this, so an online request finds a worker not busy prefilling
    prefill_budget_tokens: int | None = None


MODEL = "sim"  # the one model a simulated cluster serves (policy/pressure.py tracks per model)
LEASE_MS = 10**12  # simulated gateways never die: a lease lasts until its request finishes


def sim_rid(request_id: int) -> str:
    """AdmissionState id of a simulated request: zero-padded, so Redis-ZSET order is numeric order."""
    return f"{request_id:010d}"


def best_worker(profile: EngineProfile, req: SimRequest, cluster: ClusterView) -> tuple[int, float]:
    """(uncached prompt tokens, predicted engine TTFT) on the worker where the TTFT is lowest: its
    pending prefill at one chunk per step, then this prompt's uncached part (Mooncake's queue time +
    prefill time)."""
    best: tuple[int, float] | None = None
    blocks = req.block_tokens
    chunk = profile.max_num_batched_tokens
    chunk_s = prefill_time_s(profile, chunk, 0)
    for wid in cluster.worker_ids:
        cached = sum(blocks[: cluster.cached_prefix_blocks(wid, req)])
        uncached = req.input_tokens - cached
        # prompts ahead are separate requests: chunked prefill clears them at one chunk per step
        ahead_s = cluster.pending_prefill_tokens(wid) / chunk * chunk_s
        ttft = ahead_s + prefill_time_s(profile, max(1, uncached), cached)
        if best is None or ttft < best[1]:
            best = (uncached, ttft)
    return best or (req.input_tokens, 0.0)


class SimHooks(AdmissionHooks):
    """The simulator's side of `AdmissionState`: which requests its ids stand for, the granted requests
    not yet dispatched, the dropped ones, and the simulator-only rules (the SLO re-checks and the
    prefill budget), each off unless its setting asks for it."""

    def __init__(self, profile: EngineProfile, config: KvgateConfig) -> None:
        self.profile = profile
        self.slo_reject = config.slo_reject
        self.prefill_budget = config.prefill_budget_tokens
        self.requests: dict[str, SimRequest] = {}  # queued or running, by AdmissionState id
        self.engine_ttft_s: dict[str, float] = {}  # predicted at arrival (the queue-time SLO check)
        self.ready: list[SimRequest] = []  # granted, not yet dispatched
        self.ready_tokens = 0  # their prompt tokens: pending prefill the cluster does not see yet
        self.dropped_ids: list[int] = []  # left the queue without a grant (the runner marks them rejected)
        self.cluster: ClusterView | None = None  # the cluster last seen (the same object every call)

    def band_open(self, band: Band, now_ms: int) -> bool:
        budget, cluster = self.prefill_budget, self.cluster
        if band >= Band.HIGH or budget is None or cluster is None:
            return True
        # granted requests join the cluster's pending prefill only when dispatched, after this pump
        pending = self.ready_tokens + sum(cluster.pending_prefill_tokens(w) for w in cluster.worker_ids)
        return pending < budget

    def accepts_wait(self, rid: str, est_wait_s: float) -> bool:
        req = self.requests[rid]
        if not self.slo_reject or req.slo_ttft_s is None:
            return True
        return est_wait_s + self.engine_ttft_s[rid] <= req.slo_ttft_s

    def still_wanted(self, rid: str, now_ms: int) -> bool:
        """SLO re-check at grant time: its seats would buy a late answer (429 now, seats to the next)."""
        req = self.requests[rid]
        if not self.slo_reject or req.slo_ttft_s is None or self.cluster is None:
            return True
        ttft_s = best_worker(self.profile, req, self.cluster)[1]
        return now_ms + _ms(ttft_s) <= _ms(req.arrival_s + req.slo_ttft_s)

    def granted(self, rid: str, now_ms: int) -> None:
        req = self.requests[rid]
        self.ready.append(req)
        self.ready_tokens += req.input_tokens

    def dropped(self, rid: str, now_ms: int) -> None:
        self.dropped_ids.append(self.forget(rid).id)

    def forget(self, rid: str) -> SimRequest:
        self.engine_ttft_s.pop(rid, None)
        return self.requests.pop(rid)


class KvgateGate(BaseGate):
    """`kvgate`: policy/admission.py's `AdmissionState` (the Lua scripts' twin) behind the simulator's
    gate interface, plus the simulator-only rules as `AdmissionHooks` (`SimHooks`).

    - Global quota in seats from capacity: `default_quota(workers, seats_per_worker, shares)`, where a
      seat is `tokens_per_seat` KV tokens and a worker holds `capacity_tokens // tokens_per_seat`
      seats; a request asks for `seat_count(uncached prompt on the best worker, max_tokens)` seats,
      which `AdmissionState` clamps (the gateway sizes seats the same way, plugin/admit.py).
    - Bands, borrowing, fair queues by tenant, aging, the grant pump, queue limits, wait budgets and
      their deadlines: `AdmissionState`, operation for operation (acquire at an arrival, release at a
      finish, `pump` = check.lua when the simulator offers a release).
    - Wait budget: the request's TTFT SLO, else the band's `wait_s` (`max_wait_ms` of the acquire).
    - Queue length per band: `queue_limit(measured arrival rate, wait_s[band])` written into the
      quota's `queue_max:<b>` before each acquire (simulator-only: the gateway's is static).
    - Shedding under sustained pressure: `policy.pressure.PressureTracker`, the gateway's own, fed
      after every operation (the gateway feeds it once a second).
    - SLO-aware early rejection (Mooncake, PEERS.md §2.4), simulator-only where it needs a TTFT
      prediction inside the queue: refuse at the door when the predicted TTFT on the best worker (its
      pending prefill + this prompt) exceeds the SLO (the gateway does this too, plugin/placement.py);
      refuse a request that would queue when `estimated_wait_s` + that TTFT does (`accepts_wait`); and
      at grant time when the predicted TTFT from now does (`still_wanted`: the waiter leaves, 429).
    - Prefill budget (`kvgate_prefill`, simulator-only): bands below high are not granted while the
      cluster's pending prefill is at or above the budget (`band_open`)."""

    name = "kvgate"

    def __init__(
        self, profile: EngineProfile, workers: int, config: KvgateConfig | None = None, name: str = "kvgate"
    ) -> None:
        super().__init__()
        self.name = name
        self.profile = profile
        self.config = cfg = config or KvgateConfig()
        per_worker = cfg.seats_per_worker or max(1, profile.capacity_tokens // max(1, cfg.tokens_per_seat))
        self.hooks = SimHooks(profile, cfg)
        self.dropped = self.hooks.dropped_ids
        quota = replace(default_quota(workers, per_worker, cfg.shares), aging_ms=cfg.aging_ms)
        self.state = AdmissionState(quota, hooks=self.hooks)
        self.pressure = PressureTracker()
        self.arrivals: dict[Band, deque[float]] = {b: deque() for b in Band}

    @property
    def quota(self) -> Quota:
        return self.state.quota

    @quota.setter
    def quota(self, quota: Quota) -> None:
        self.state.quota = quota

    @property
    def ready(self) -> list[SimRequest]:
        return self.hooks.ready

    @property
    def release_on_first_token(self) -> bool:
        """A prefill budget frees at first tokens: the loop must offer the gate a release then too."""
        return self.config.prefill_budget_tokens is not None

    # ---- AdmissionGate ----------------------------------------------------------------------------

    def admit(self, req: SimRequest, cluster: ClusterView, now_s: float) -> Verdict:
        hooks, cfg, band = self.hooks, self.config, req.band
        hooks.cluster = cluster
        uncached, engine_ttft = best_worker(self.profile, req, cluster)
        if cfg.slo_reject and req.slo_ttft_s is not None and engine_ttft > req.slo_ttft_s:
            return Verdict.REJECT
        if self.pressure.sheds(MODEL, band, now_s, cfg.shed_low_after_s or 0.0):
            return Verdict.REJECT  # shed batch traffic first
        if cfg.qps_window_s > 0:
            self._measure_queue_limit(band, now_s)
        rid = sim_rid(req.id)
        hooks.requests[rid] = req
        hooks.engine_ttft_s[rid] = engine_ttft
        budget_s = req.slo_ttft_s if req.slo_ttft_s is not None else cfg.wait_s[band]
        seats = seat_count(uncached, req.output_tokens, cfg.tokens_per_seat, cfg.max_seats)
        result = self.state.acquire(_ms(now_s), rid, band, req.tenant, seats, LEASE_MS, _ms(budget_s))
        self._observe(now_s)
        if result.code is AdmitCode.ADMITTED:
            hooks.ready.remove(req)  # dispatched now, not at the next release
            hooks.ready_tokens -= req.input_tokens
            return Verdict.ADMIT
        if result.code is AdmitCode.QUEUED:
            return Verdict.QUEUE
        if rid in hooks.requests:
            hooks.forget(rid)
        else:  # `still_wanted` turned it away in its own acquire: a refusal at the door, not a drop
            hooks.dropped_ids.remove(req.id)
        return Verdict.REJECT

    def release(self, cluster: ClusterView, now_s: float) -> Sequence[SimRequest]:
        self.hooks.cluster = cluster
        self.state.pump(_ms(now_s))
        self._observe(now_s)
        hooks = self.hooks
        out, hooks.ready, hooks.ready_tokens = hooks.ready, [], 0
        return out

    def queued(self) -> int:
        return len(self.state.waiters) + len(self.hooks.ready)

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        rid = sim_rid(req.id)
        if rid not in self.state.leases:
            return
        self.hooks.forget(rid)
        self.state.release(_ms(now_s), rid)
        self._observe(now_s)

    # ---- simulator-side inputs of the shared rules ---------------------------------------------------

    def _measure_queue_limit(self, band: Band, now_s: float) -> None:
        """queue_max:<b> = queue_limit(arrivals of the band in the last window / window, wait_s[band])."""
        window = self.arrivals[band]
        window.append(now_s)
        while window and window[0] < now_s - self.config.qps_window_s:
            window.popleft()
        limit = queue_limit(len(window) / self.config.qps_window_s, self.config.wait_s[band])
        quota = self.state.quota
        if quota.queue_max_band.get(band) != limit:
            self.state.quota = replace(quota, queue_max_band={**quota.queue_max_band, band: limit})

    def _observe(self, now_s: float) -> None:
        state = self.state
        self.pressure.observe(MODEL, {b: state.queue_length(b) for b in Band}, now_s)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


class GatedRouter:
    """A Router that forwards its hooks to the gate too (the gate learns which requests ended)."""

    def __init__(self, inner: Router, gate: BaseGate) -> None:
        self.inner = inner
        self.gate = gate
        self.name = inner.name
        if isinstance(gate, QueueGuardGate) and isinstance(inner, PolicyRouter):
            inner.door = gate.refuses  # the guard reads the decision, as the gateway's door does

    def route(self, req: SimRequest, cluster: ClusterView, now_s: float) -> str:
        return self.inner.route(req, cluster, now_s)

    def on_first_token(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        self.inner.on_first_token(req, worker_id, now_s)
        self.gate.on_first_token(req, worker_id, now_s)

    def on_finish(self, req: SimRequest, worker_id: str, now_s: float) -> None:
        self.inner.on_finish(req, worker_id, now_s)
        self.gate.on_finish(req, worker_id, now_s)

    def on_usage(self, req: SimRequest, worker_id: str, cached_tokens: int, now_s: float) -> None:
        self.inner.on_usage(req, worker_id, cached_tokens, now_s)


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
    "kvgate_guard": lambda profile, workers, seed: QueueGuardGate(profile),
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
