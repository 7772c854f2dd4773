"""Global admission rules as pure functions and a pure state machine (the Lua scripts' twin).

Modelled on Kubernetes API Priority and Fairness, for LLM requests that cannot be pre-empted:

- **Seats.** A request occupies `seat_count(uncached_prompt_tokens, max_tokens)` seats:
  `ceil((uncached + max_tokens) / tokens_per_seat)`, at least 1, at most `max_seats` and at most the
  smallest limit that applies to it (so it can always run eventually). `tokens_per_seat = 0`, or the
  quota's `seats = 0`, counts requests instead (1 seat each).
- **Limits** (`Quota`; an absent limit is unlimited): the model `total`; per band a nominal share
  `band[b]`; per tenant `tenant` (default) or `tenants[t]`. A band over its nominal may **borrow**
  up to `borrow[b]` seats, only while it and every lower band together stay within their combined
  nominal seats (it borrows what lower bands leave unused; the loan is returned as its requests end).
  A band may **reserve** `reserve[b]` seats of the total: a request of a lower band is admitted only
  if it leaves that many seats free, so a burst of band b (or above) finds seats at once instead of
  waiting for a completion while lower bands hold everything.
- **Queues**, one per band, ordered by a **fair tag** (self-clocked fair queuing by tenant):
  `tag = max(vtime[b], last_tag[b][tenant]) + seats`, where `vtime[b]` is the tag of the band's
  last grant; a tenant's flood gets ever larger tags, so other tenants interleave with it.
  Equal tags go in request-id order (Redis ZSET order).
- **Between bands**: strict priority with **aging**. A band's effective priority is
  `band + floor((now - since[b]) / aging_ms)`, where `since[b]` is when the band was last served (or
  became non-empty). Highest wins; ties go to the band served longest ago. So a waiting band is
  served at least once per `max_band_wait_ms` = `(HIGH - band + 1) * aging_ms` plus one seat
  turnover (it ties with a busy high band after `HIGH - band` periods; one more covers a middle band
  that waited longer): with the default 5 s, a low band at least every ~15 s, which bounds a low
  request's wait to its fair position in its band × that.
- **Grants**: each band offers its first queued request (among the first `SCAN`) whose tenant and
  band limits allow it; the best band's offer is granted if it fits the model total, else nothing
  is granted (seats are kept for it: small requests do not starve big ones).
- **Queue length**: `queue_limit(expected_qps, acceptable_wait_s)`; a full band queue rejects.

`AdmissionState` applies these rules step by step, exactly as `store/lua/*.lua` do on Redis;
`tests/property/test_admission_agrees.py` feeds both the same operations and compares every reply.
`AdmissionHooks` are its extension points for rules the Lua scripts do not run (the simulator's
prefill budget and SLO re-checks, docs/ADMISSION.md "Hooks"); the defaults change nothing, so with
them `AdmissionState` is the scripts' twin.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum

from policy.types import Band

SCAN = 8
MAX_GRANTS = 64
DEFAULT_AGING_MS = 5000
DEFAULT_QUEUE_MAX = 1024
DEFAULT_TOKENS_PER_SEAT = 4096
DEFAULT_MAX_SEATS = 16
# the engine-queue guard (queue_too_deep; the gateway's `[admission] max_queue_ms` / `queue_signal`): on
# by default since session 12, at the setting measured live at 0.8 and 4x (docs/BENCHMARKS.md §64, §67,
# §70): the SLO as budget on the dispatched prefill (a lower bound of the real wait, so a refused request
# would have missed the SLO anyway); 0 refusals at 0.8 on every workload, goodput 1.36-1.77x sglang-router's
# at 4x. The simulator's kvgate_guard gate runs the same default
DEFAULT_MAX_QUEUE_MS = 2000
DEFAULT_QUEUE_SIGNAL = "dispatched"
# the guard's wait signal (`[admission] queue_signal`) -> the routing decision's score that carries it
# (policy/kvgate.py): the queue's lateness counted, or only the prefill this gateway dispatched, or that
# dispatched prefill plus the request's own uncached prefill there (its predicted TTFT without lateness:
# at the same queue a miss is refused before a hit, since refusing a miss frees more prefill than
# refusing a hit, and a refused hit warms no cache either way)
QUEUE_SIGNALS: Mapping[str, str] = {
    "lateness": "queue-wait",
    "dispatched": "dispatched-wait",
    "dispatched_ttft": "predicted-ttft",
}
# default band shares of the model total (default_quota): batch traffic is capped, online may borrow
DEFAULT_SHARES: Mapping[Band, float] = {Band.HIGH: 0.5, Band.NORMAL: 0.3, Band.LOW: 0.2}


class AdmitCode(IntEnum):
    """acquire.lua's reply codes."""

    ADMITTED = 1
    QUEUED = 2
    ALREADY_HELD = 3
    ALREADY_QUEUED = 4
    NO_SEAT = -1  # nothing free and the request would not wait
    QUEUE_FULL = -2
    WORKER_FULL = -3  # two-step admission: the chosen worker has no room; nothing taken or queued
    QUOTA_MISSING = -4  # the model's quota hash is gone (Redis restarted): refused, never unlimited
    WAIT_REFUSED = -5  # AdmissionHooks.accepts_wait refused the predicted wait (never from the scripts)


class ClaimCode(IntEnum):
    """claim.lua's reply codes (placing a granted lease on a worker)."""

    GONE = 0
    PLACED = 1
    WORKER_FULL = -3


class ReleaseCode(IntEnum):
    UNKNOWN = 0  # already released, expired, or never admitted
    RELEASED = 1
    LEFT_QUEUE = 2


class CheckStatus(IntEnum):
    GONE = 0
    HELD = 1
    QUEUED = 2


@dataclass(frozen=True, slots=True)
class Quota:
    """One model's admission limits, as stored in the `kvg:{m}:quota` HASH. None = unlimited."""

    total: int | None = None
    band: Mapping[Band, int] = field(default_factory=dict)  # nominal seats per band
    borrow: Mapping[Band, int] = field(default_factory=dict)  # seats a band may borrow beyond nominal
    reserve: Mapping[Band, int] = field(default_factory=dict)  # free seats lower bands must leave it
    tenant: int | None = None  # default per-tenant cap (all bands of the model together)
    tenants: Mapping[str, int] = field(default_factory=dict)  # per-tenant overrides
    queue_max: int = DEFAULT_QUEUE_MAX  # waiters per band queue
    queue_max_band: Mapping[Band, int] = field(default_factory=dict)
    aging_ms: int = DEFAULT_AGING_MS  # 0 = strict priority, no aging
    count_seats: bool = True  # False: every request is 1 seat

    def to_hash(self) -> dict[str, str]:
        out: dict[str, str] = {"queue_max": str(self.queue_max), "aging_ms": str(self.aging_ms)}
        if self.total is not None:
            out["total"] = str(self.total)
        if self.tenant is not None:
            out["tenant"] = str(self.tenant)
        if not self.count_seats:
            out["seats"] = "0"
        out.update({f"band:{int(b)}": str(v) for b, v in self.band.items()})
        out.update({f"borrow:{int(b)}": str(v) for b, v in self.borrow.items()})
        out.update({f"reserve:{int(b)}": str(v) for b, v in self.reserve.items()})
        out.update({f"queue_max:{int(b)}": str(v) for b, v in self.queue_max_band.items()})
        out.update({f"tenant:{t}": str(v) for t, v in self.tenants.items()})
        return out

    @classmethod
    def from_hash(cls, flat: Mapping[str, str]) -> Quota:
        def num(key: str) -> int | None:
            return int(float(flat[key])) if key in flat else None

        def per_band(prefix: str) -> dict[Band, int]:
            return {b: v for b in Band if (v := num(f"{prefix}:{int(b)}")) is not None}

        return cls(
            total=num("total"),
            band=per_band("band"),
            borrow=per_band("borrow"),
            reserve=per_band("reserve"),
            tenant=num("tenant"),
            tenants={
                k.removeprefix("tenant:"): int(float(v)) for k, v in flat.items() if k.startswith("tenant:")
            },
            queue_max=num("queue_max") or DEFAULT_QUEUE_MAX,
            queue_max_band=per_band("queue_max"),
            aging_ms=DEFAULT_AGING_MS if (a := num("aging_ms")) is None else a,
            count_seats=num("seats") != 0,
        )

    def tenant_cap(self, tenant: str) -> int | None:
        return self.tenants.get(tenant, self.tenant)

    def queue_limit(self, band: Band) -> int:
        return self.queue_max_band.get(band, self.queue_max)


@dataclass(frozen=True, slots=True)
class Usage:
    """Seats held by live leases."""

    total: int = 0
    band: Mapping[Band, int] = field(default_factory=dict)
    tenant: Mapping[str, int] = field(default_factory=dict)
    worker: Mapping[str, int] = field(default_factory=dict)  # requests (not seats) placed per worker


# ---- pure rules ---------------------------------------------------------------------------------


def seat_count(
    uncached_prompt_tokens: int,
    max_tokens: int,
    tokens_per_seat: int = DEFAULT_TOKENS_PER_SEAT,
    max_seats: int = DEFAULT_MAX_SEATS,
) -> int:
    """Seats a request occupies: ceil((uncached prompt + max_tokens) / tokens_per_seat), in [1, max_seats]."""
    if tokens_per_seat <= 0:
        return 1
    cost = max(0, uncached_prompt_tokens) + max(0, max_tokens)
    return max(1, min(max_seats, math.ceil(cost / tokens_per_seat)))


def clamp_seats(seats: int, quota: Quota, band: Band, tenant: str) -> int:
    """At least 1, at most the smallest limit (>= 1) that applies, so the request can always run."""
    if not quota.count_seats:
        return 1
    cap = max(1, seats)
    limits = [quota.total, quota.tenant_cap(tenant)]
    if band in quota.band:
        limits.append(quota.band[band] + quota.borrow.get(band, 0))
    if quota.total is not None and (reserve := reserved_above(quota, band)) > 0:
        limits.append(quota.total - reserve)
    for limit in limits:
        if limit is not None and 1 <= limit < cap:
            cap = limit
    return cap


def tenant_ok(quota: Quota, usage: Usage, tenant: str, seats: int) -> bool:
    cap = quota.tenant_cap(tenant)
    return cap is None or usage.tenant.get(tenant, 0) + seats <= cap


def reserved_above(quota: Quota, band: Band) -> int:
    """Seats of the total a request of `band` must leave free: the largest reserve of a higher band."""
    return max((v for b, v in quota.reserve.items() if b > band), default=0)


def band_ok(quota: Quota, usage: Usage, band: Band, seats: int) -> bool:
    """Leaves the seats higher bands reserve free, and is within its nominal seats, or borrowing (up to
    borrow[band]) seats lower bands leave unused."""
    reserve = reserved_above(quota, band)
    if quota.total is not None and reserve > 0 and usage.total + seats + reserve > quota.total:
        return False
    nominal = quota.band.get(band)
    if nominal is None:
        return True
    used = usage.band.get(band, 0)
    if used + seats <= nominal:
        return True
    if used + seats > nominal + quota.borrow.get(band, 0):
        return False
    lower = [b for b in Band if b <= band and b in quota.band]
    pool = sum(quota.band[b] for b in lower)
    used_pool = sum(usage.band.get(b, 0) for b in lower)
    return used_pool + seats <= pool


def total_ok(quota: Quota, usage: Usage, seats: int) -> bool:
    return quota.total is None or usage.total + seats <= quota.total


def admissible(quota: Quota, usage: Usage, band: Band, tenant: str, seats: int) -> bool:
    """Every limit allows `seats` more seats for this band and tenant right now."""
    return (
        tenant_ok(quota, usage, tenant, seats)
        and band_ok(quota, usage, band, seats)
        and total_ok(quota, usage, seats)
    )


def worker_full(usage: Usage, worker: str, max_concurrency: int) -> bool:
    """Step two: the worker runs `max_concurrency` requests at once (0 = unknown: never full)."""
    return max_concurrency > 0 and usage.worker.get(worker, 0) >= max_concurrency


def fair_tag(vtime: int, tenant_last_tag: int | None, seats: int) -> int:
    """Queue order inside a band (self-clocked fair queuing by tenant): smaller goes first."""
    return max(vtime, tenant_last_tag or 0) + seats


def effective_priority(band: Band, since_ms: int, now_ms: int, aging_ms: int) -> int:
    """A band's priority plus one level per whole `aging_ms` it has waited unserved."""
    return int(band) if aging_ms <= 0 else int(band) + (now_ms - since_ms) // aging_ms


def max_band_wait_ms(band: Band, aging_ms: int) -> int | None:
    """Longest a non-empty band waits for a turn beyond one seat turnover (None: unbounded, no aging)."""
    return None if aging_ms <= 0 else (int(Band.HIGH) - int(band) + 1) * aging_ms


def queue_limit(expected_qps: float, acceptable_wait_s: float) -> int:
    """Queue length from 'expected QPS x acceptable wait' (the article's rule), at least 1."""
    return max(1, math.ceil(expected_qps * acceptable_wait_s))


def estimated_wait_s(ahead: int, capacity_seats: int, mean_hold_s: float, default_s: float = 1.0) -> float:
    """Wait for a request with `ahead` waiters before it: (ahead + 1) x mean hold time / capacity.

    With no measurement yet (mean_hold_s <= 0) or an unknown capacity, `default_s` per position."""
    if mean_hold_s <= 0 or capacity_seats <= 0:
        return default_s * (ahead + 1)
    return (ahead + 1) * mean_hold_s / capacity_seats


def queue_too_deep(band: Band, predicted_wait_s: float, max_queue_s: float) -> bool:
    """The engine-queue guard at the door: refuse a request below HIGH when the chosen worker's
    predicted wait before its own prefill (the prompts queued ahead of it there, or the lateness that
    queue already shows, whichever is longer) exceeds `max_queue_s`; `max_queue_s <= 0` turns it off.
    The request would only start late and lengthen the queue for everyone behind it; refused at once,
    it can retry (Retry-After) or go elsewhere. HIGH is never refused by it: with the bands below held
    back, the engines' queues stay short for high traffic (the simulator's prefill budget does the
    same with a global count, docs/ADMISSION.md "Overload settings")."""
    return max_queue_s > 0 and band < Band.HIGH and predicted_wait_s > max_queue_s


def door_wait_s(chosen_scores: Mapping[str, float], queue_signal: str) -> float | None:
    """The predicted wait the engine-queue guard compares with its budget (`queue_too_deep`): the routing
    decision's score named by `QUEUE_SIGNALS[queue_signal]` on the chosen worker. None when the policy
    predicts none (round_robin, least_loaded, article): the guard skips it. The gateway's door
    (plugin/placement.py) and the simulator's `kvgate_guard` gate (bench/sim/admission.py) both read it."""
    return chosen_scores.get(QUEUE_SIGNALS[queue_signal])


def default_quota(
    workers: int, per_worker_concurrency: int, shares: Mapping[Band, float] = DEFAULT_SHARES
) -> Quota:
    """Limits from capacity: total = workers x per-worker concurrency, split into band shares; the
    high and normal bands may borrow whatever lower bands leave unused, the low band may not."""
    total = max(1, workers * per_worker_concurrency)
    band = {b: int(total * shares.get(b, 0.0)) for b in Band}
    for b in sorted(Band, reverse=True):  # a band with a share gets a seat when the total allows:
        if shares.get(b, 0.0) > 0 and band[b] == 0 and sum(band.values()) < total:
            band[b] = 1  # int() of a small total's share would otherwise starve it
    band[Band.HIGH] += total - sum(band.values())  # rounding remainder to the online band
    return Quota(total=total, band=band, borrow={Band.HIGH: total, Band.NORMAL: total, Band.LOW: 0})


# ---- the state machine the Lua scripts implement --------------------------------------------------
# One family of replies for both: `AdmissionState` below and the scripts' wrappers (store/scripts.py),
# which also fill in what only the server knows (hold time, capacity, its clock).


class AdmissionHooks:
    """Extension points of `AdmissionState` for rules beyond the scripts'. These defaults change nothing
    (the Lua scripts' behaviour); the simulator's kvgate gate overrides them (bench/sim/admission.py).
    Every hook is pure: it may read what it was given, never do I/O."""

    def band_open(self, band: Band, now_ms: int) -> bool:
        """May the pump grant this band now? (False: its waiters wait, other bands go on.)"""
        return True

    def still_wanted(self, rid: str, now_ms: int) -> bool:
        """Is a grant still worth it, for the waiter the pump is about to grant? False: it leaves the
        queue instead (reported through `dropped`) and its seats go to the next offer."""
        return True

    def accepts_wait(self, rid: str, est_wait_s: float) -> bool:
        """May a request that has to queue wait `est_wait_s` (`estimated_wait_s` of its position)?
        False: refused like a full queue (AdmitCode.WAIT_REFUSED)."""
        return True

    def granted(self, rid: str, now_ms: int) -> None:
        """Observation: the pump granted `rid` (at once or after a wait)."""

    def dropped(self, rid: str, now_ms: int) -> None:
        """Observation: a waiter left without a grant (its wait budget ran out, or `still_wanted`)."""


NO_HOOKS = AdmissionHooks()


@dataclass(frozen=True, slots=True)
class AdmitResult:
    code: AdmitCode
    seats: int
    ahead: int  # waiters before it in its band + all waiters in higher bands
    granted: tuple[str, ...]  # other waiters this call granted
    hold_ms: int = 0  # moving average of how long leases are held (0 = no data yet; scripts only)
    capacity: int = -1  # model total in seats, -1 = unlimited (scripts only)
    now_ms: int = 0  # the clock the decision used (scripts only)


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    code: ReleaseCode
    granted: tuple[str, ...]
    hold_ms: int = 0


@dataclass(frozen=True, slots=True)
class CheckResult:
    status: CheckStatus
    ahead: int
    granted: tuple[str, ...]
    hold_ms: int = 0
    capacity: int = -1


@dataclass(frozen=True, slots=True)
class ClaimResult:
    code: ClaimCode
    granted: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RenewResult:
    lost: tuple[str, ...]  # leases that had already expired (their seats are gone)
    granted: tuple[str, ...]


@dataclass(slots=True)
class _Lease:
    seats: int
    band: Band
    tenant: str
    expiry_ms: int
    granted_ms: int
    worker: str = ""


@dataclass(slots=True)
class _Waiter:
    seats: int
    band: Band
    tenant: str
    lease_ms: int
    deadline_ms: int
    tag: int
    worker: str = ""


@dataclass
class AdmissionState:
    """One model's leases and queues. Each operation reaps what expired by `now_ms`, does its work, then
    grants freed seats to waiters, exactly as the Lua scripts do; the simulator drives it directly.

    Read `leases`, `waiters`, `usage()` and `queue()`; change state only through the operations (the
    private indexes below keep queue order, expiry heaps and seat counts in step with them)."""

    quota: Quota = field(default_factory=Quota)
    hooks: AdmissionHooks = NO_HOOKS
    leases: dict[str, _Lease] = field(default_factory=dict)
    waiters: dict[str, _Waiter] = field(default_factory=dict)
    vtime: dict[Band, int] = field(default_factory=dict)
    since: dict[Band, int] = field(default_factory=dict)
    tags: dict[Band, dict[str, int]] = field(default_factory=dict)
    hold_ms: int | None = None  # moving average of lease hold times
    # indexes: per band (tag, id bytes, id) sorted like a Redis ZSET; lazy expiry heaps; seat counts
    _order: dict[Band, list[tuple[int, bytes, str]]] = field(default_factory=lambda: {b: [] for b in Band})
    _lease_expiry: list[tuple[int, str]] = field(default_factory=list)
    _deadlines: list[tuple[int, str]] = field(default_factory=list)
    _used_band: dict[Band, int] = field(default_factory=dict)
    _used_tenant: dict[str, int] = field(default_factory=dict)
    _used_worker: dict[str, int] = field(default_factory=dict)

    def usage(self) -> Usage:
        """Seats held by live leases (a copy)."""
        return Usage(
            sum(self._used_band.values()),
            {b: v for b, v in self._used_band.items() if v},
            {t: v for t, v in self._used_tenant.items() if v},
            {w: v for w, v in self._used_worker.items() if v},
        )

    def queue(self, band: Band) -> list[str]:
        """Waiting request ids of one band in grant order (fair tag, then id: Redis ZSET order)."""
        return [rid for _, _, rid in self._order[band]]

    def queue_length(self, band: Band) -> int:
        return len(self._order[band])

    def ahead(self, rid: str) -> int:
        w = self.waiters[rid]
        higher = sum(len(self._order[b]) for b in Band if b > w.band)
        return bisect.bisect_left(self._order[w.band], (w.tag, rid.encode(), rid)) + higher

    def acquire(
        self,
        now_ms: int,
        rid: str,
        band: Band,
        tenant: str,
        seats: int,
        lease_ms: int,
        max_wait_ms: int,
        worker: str = "",
        worker_cap: int = 0,
    ) -> AdmitResult:
        """Admit at once (on `worker` if given), queue, or reject; see AdmitCode."""
        self._reap(now_ms)
        if rid in self.leases:
            return AdmitResult(AdmitCode.ALREADY_HELD, 0, 0, self._pump(now_ms))
        if rid in self.waiters:
            return AdmitResult(AdmitCode.ALREADY_QUEUED, 0, 0, self._pump(now_ms))
        seats = clamp_seats(seats, self.quota, band, tenant)
        if worker and worker_full(self._live_usage(), worker, worker_cap):
            return AdmitResult(AdmitCode.WORKER_FULL, seats, 0, self._pump(now_ms))
        was_empty = not self._order[band]
        band_tags = self.tags.setdefault(band, {})
        prev_tag = band_tags.get(tenant)
        tag = fair_tag(self.vtime.get(band, 0), prev_tag, seats)
        self._enqueue(rid, _Waiter(seats, band, tenant, lease_ms, now_ms + max(max_wait_ms, 0), tag, worker))
        band_tags[tenant] = tag
        if was_empty:
            self.since[band] = now_ms
        pumped = self._pump(now_ms)
        granted = tuple(g for g in pumped if g != rid)
        if rid in pumped:
            return AdmitResult(AdmitCode.ADMITTED, seats, 0, granted)
        if rid not in self.waiters:  # AdmissionHooks.still_wanted turned it away in this very pump
            return AdmitResult(AdmitCode.WAIT_REFUSED, seats, 0, granted)
        ahead = self.ahead(rid)
        full = len(self._order[band]) - 1 >= self.quota.queue_limit(band)
        refused = (
            not full and max_wait_ms > 0 and not self.hooks.accepts_wait(rid, self.estimated_wait_s(ahead))
        )
        if max_wait_ms <= 0 or full or refused:
            self._leave(rid)
            if self._order[band]:
                if prev_tag is None:
                    del self.tags[band][tenant]
                else:
                    self.tags[band][tenant] = prev_tag
            code = (
                AdmitCode.NO_SEAT
                if max_wait_ms <= 0
                else AdmitCode.QUEUE_FULL
                if full
                else AdmitCode.WAIT_REFUSED
            )
            return AdmitResult(code, seats, ahead, granted)
        self.waiters[rid].worker = ""  # placed after its grant, when the gateway routes it again
        return AdmitResult(AdmitCode.QUEUED, seats, ahead, granted)

    def claim(
        self, now_ms: int, rid: str, worker: str, worker_cap: int = 0
    ) -> tuple[ClaimCode, tuple[str, ...]]:
        """Place a held lease on `worker` (step two after a wait); returns (code, granted ids)."""
        self._reap(now_ms)
        code = ClaimCode.GONE
        if (lease := self.leases.get(rid)) is not None:
            if lease.worker == worker:
                code = ClaimCode.PLACED
            elif worker_full(self._live_usage(), worker, worker_cap):
                code = ClaimCode.WORKER_FULL
            else:
                self._count(lease, -1)
                lease.worker = worker
                self._count(lease, 1)
                code = ClaimCode.PLACED
        return code, self._pump(now_ms)

    def release(self, now_ms: int, rid: str) -> ReleaseResult:
        """End a request wherever it is (lease or queue); idempotent."""
        self._reap(now_ms)
        code = ReleaseCode.UNKNOWN
        if (lease := self._drop(rid)) is not None:
            code = ReleaseCode.RELEASED
            held = now_ms - lease.granted_ms
            self.hold_ms = held if self.hold_ms is None else math.floor(self.hold_ms * 0.9 + held * 0.1)
        elif self._leave(rid):
            code = ReleaseCode.LEFT_QUEUE
        return ReleaseResult(code, self._pump(now_ms))

    def renew(self, now_ms: int, rids: list[str], lease_ms: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Extend leases, before reaping: a lease past its expiry that no call has reaped yet (its seats
        were never given away, e.g. after a Redis pause) is its holder's again. Returns (lost, granted)."""
        lost = []
        for rid in rids:
            if (lease := self.leases.get(rid)) is not None:
                lease.expiry_ms = now_ms + lease_ms
                heapq.heappush(self._lease_expiry, (lease.expiry_ms, rid))
            else:
                lost.append(rid)
        self._reap(now_ms)
        return tuple(lost), self._pump(now_ms)

    def pump(self, now_ms: int) -> tuple[str, ...]:
        """Reap, then grant what fits: `check` without a request (check.lua with an unknown id)."""
        self._reap(now_ms)
        return self._pump(now_ms)

    def estimated_wait_s(self, ahead: int) -> float:
        """`estimated_wait_s` from this state's capacity and mean hold time (what the gateway shows)."""
        total = -1 if self.quota.total is None else self.quota.total
        return estimated_wait_s(ahead, total, (self.hold_ms or 0) / 1000)

    def check(self, now_ms: int, rid: str) -> CheckResult:
        self._reap(now_ms)
        granted = self._pump(now_ms)
        if rid in self.leases:
            return CheckResult(CheckStatus.HELD, 0, granted)
        if rid in self.waiters:
            return CheckResult(CheckStatus.QUEUED, self.ahead(rid), granted)
        return CheckResult(CheckStatus.GONE, 0, granted)

    # ---- internals (each mirrors a helper of common.lua) ----

    def _live_usage(self) -> Usage:
        """Seat counts without copying (for the rule functions inside one operation)."""
        return Usage(sum(self._used_band.values()), self._used_band, self._used_tenant, self._used_worker)

    def _count(self, lease: _Lease, sign: int) -> None:
        self._used_band[lease.band] = self._used_band.get(lease.band, 0) + sign * lease.seats
        self._used_tenant[lease.tenant] = self._used_tenant.get(lease.tenant, 0) + sign * lease.seats
        if lease.worker:
            self._used_worker[lease.worker] = self._used_worker.get(lease.worker, 0) + sign

    def _drop(self, rid: str) -> _Lease | None:
        lease = self.leases.pop(rid, None)
        if lease is not None:
            self._count(lease, -1)
        return lease

    def _enqueue(self, rid: str, w: _Waiter) -> None:
        self.waiters[rid] = w
        bisect.insort(self._order[w.band], (w.tag, rid.encode(), rid))
        heapq.heappush(self._deadlines, (w.deadline_ms, rid))

    def _reap(self, now_ms: int) -> None:
        while self._lease_expiry and self._lease_expiry[0][0] <= now_ms:
            expiry, rid = heapq.heappop(self._lease_expiry)
            if (lease := self.leases.get(rid)) is not None and lease.expiry_ms == expiry:
                self._drop(rid)
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            deadline, rid = heapq.heappop(self._deadlines)
            if (w := self.waiters.get(rid)) is not None and w.deadline_ms == deadline:
                self._leave(rid)
                self.hooks.dropped(rid, now_ms)

    def _leave(self, rid: str) -> bool:
        w = self.waiters.pop(rid, None)
        if w is None:
            return False
        order = self._order[w.band]
        del order[bisect.bisect_left(order, (w.tag, rid.encode(), rid))]
        if not order:
            self.tags.pop(w.band, None)
        return True

    def _pump(self, now_ms: int) -> tuple[str, ...]:
        granted: list[str] = []
        usage, hooks = self._live_usage, self.hooks
        while len(granted) < MAX_GRANTS:
            best: tuple[str, int, int] | None = None  # rid, effective priority, since
            for band in _BANDS_DESCENDING:
                if not hooks.band_open(band, now_ms):
                    continue
                for _tag, _key, rid in self._order[band][:SCAN]:
                    w = self.waiters[rid]
                    u = usage()
                    if tenant_ok(self.quota, u, w.tenant, w.seats) and band_ok(self.quota, u, band, w.seats):
                        since = self.since.get(band, now_ms)
                        eff = effective_priority(band, since, now_ms, self.quota.aging_ms)
                        if best is None or eff > best[1] or (eff == best[1] and since < best[2]):
                            best = (rid, eff, since)
                        break
            if best is None or not total_ok(self.quota, usage(), self.waiters[best[0]].seats):
                break
            if not hooks.still_wanted(best[0], now_ms):  # a hook's refusal is no grant: not counted
                self._leave(best[0])
                hooks.dropped(best[0], now_ms)
                continue
            self._grant(now_ms, best[0])
            granted.append(best[0])
        return tuple(granted)

    def _grant(self, now_ms: int, rid: str) -> None:
        w = self.waiters[rid]
        self._leave(rid)
        lease = _Lease(w.seats, w.band, w.tenant, now_ms + w.lease_ms, now_ms, w.worker)
        self.leases[rid] = lease
        self._count(lease, 1)
        heapq.heappush(self._lease_expiry, (lease.expiry_ms, rid))
        self.vtime[w.band] = w.tag
        self.since[w.band] = now_ms
        self.hooks.granted(rid, now_ms)


_BANDS_DESCENDING = sorted(Band, reverse=True)
