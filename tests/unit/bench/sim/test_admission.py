"""Each simulator admission gate's rule, pinned on hand-made cluster states (bench/sim/admission.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sim.admission import (
    GATES,
    PREFILL_BUDGET_PER_WORKER,
    GatedRouter,
    GieFlowGate,
    GieShedGate,
    KvgateConfig,
    KvgateGate,
    NoGate,
    ProbabilisticGate,
    QueueGuardGate,
    UnknownAdmission,
    make_gate,
    resolve_admissions,
    saturation,
)
from bench.sim.cluster import Verdict, simulate
from bench.sim.profiles import load_profile
from bench.sim.registry import make_router
from bench.sim.types import Scraped, SimRequest
from policy.admission import DEFAULT_MAX_SEATS, DEFAULT_TOKENS_PER_SEAT, default_quota
from policy.types import Band, WorkerView

PROFILE = load_profile("h100-llama3.1-8b")


@dataclass
class HandCluster:
    """A ClusterView with the numbers a test sets: (waiting, kv_usage, scrape time) per worker."""

    scrapes: dict[str, Scraped]
    pending: dict[str, int] = field(default_factory=dict)
    flight: dict[str, int] = field(default_factory=dict)

    @property
    def worker_ids(self) -> Sequence[str]:
        return list(self.scrapes)

    def inflight(self, worker_id: str) -> int:
        return self.flight.get(worker_id, 0)

    def pending_prefill_tokens(self, worker_id: str) -> int:
        return self.pending.get(worker_id, 0)

    def scraped(self, worker_id: str) -> Scraped:
        return self.scrapes[worker_id]

    def cached_prefix_blocks(self, worker_id: str, req: SimRequest) -> int:
        return 0

    def capacity_tokens(self, worker_id: str) -> int:
        return PROFILE.capacity_tokens

    def max_concurrency(self, worker_id: str) -> int:
        return PROFILE.max_num_seqs

    def worker_views(self, now_s: float) -> list[WorkerView]:
        return [WorkerView(id=w) for w in self.scrapes]


def cluster(*workers: tuple[int, float], at_s: float = 0.0, inflight: int = 1) -> HandCluster:
    scrapes = {f"w{i}": Scraped(at_s, 0, waiting, kv) for i, (waiting, kv) in enumerate(workers)}
    return HandCluster(scrapes, flight=dict.fromkeys(scrapes, inflight))


IDLE = cluster((0, 0.0), (0, 0.0))
SATURATED = cluster((10, 0.9), (10, 0.9))


def req(
    rid: int, band: Band, tenant: str = "t", tokens: int = 999, out: int = 0, slo: float | None = None
) -> SimRequest:
    return SimRequest(rid, 0.0, tokens, max(1, out), (rid,), (tokens,), band, tenant, slo)


@pytest.mark.parametrize(
    ("workers", "now_s", "expected"),
    [
        pytest.param([(0, 0.0), (0, 0.0)], 0.0, 0.0, id="idle"),
        pytest.param([(5, 0.0), (0, 0.4)], 0.0, 0.75, id="waiting/5 and kv/0.8 averaged"),
        pytest.param([(0, 0.4), (10, 0.0)], 0.0, 1.25, id="the larger of the two signals per pod"),
        pytest.param([(0, 0.0), (0, 0.0)], 0.3, 1.0, id="stale metrics count as saturated"),
    ],
)
def test_saturation_is_llmd_utilization_detector(
    workers: list[tuple[int, float]], now_s: float, expected: float
) -> None:
    assert saturation(cluster(*workers), now_s) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("band", "state", "verdict"),
    [
        pytest.param(Band.LOW, SATURATED, Verdict.REJECT, id="low shed when saturated"),
        pytest.param(Band.LOW, IDLE, Verdict.ADMIT, id="low passes when not saturated"),
        pytest.param(Band.NORMAL, SATURATED, Verdict.ADMIT, id="normal never shed"),
        pytest.param(Band.HIGH, SATURATED, Verdict.ADMIT, id="high never shed"),
    ],
)
def test_gie_shed_rejects_only_sheddable_when_saturated(
    band: Band, state: HandCluster, verdict: Verdict
) -> None:
    assert GieShedGate().admit(req(1, band), state, 0.0) is verdict
    assert NoGate().admit(req(1, band), state, 0.0) is Verdict.ADMIT


@pytest.mark.parametrize(
    ("kv", "low", "high"),
    [
        pytest.param(0.0, 0.0, 0.0, id="sat 0: never"),
        pytest.param(0.12, 0.015, 0.032, id="sat 0.15: ~2.3 %"),
        pytest.param(0.26, 1.0, 1.0, id="sat 0.325: always"),
    ],
)
def test_probabilistic_rejects_low_with_300_sat_pow_5(kv: float, low: float, high: float) -> None:
    gate, state = ProbabilisticGate(seed=3), cluster((0, kv), (0, kv))
    rejected = sum(gate.admit(req(i, Band.LOW), state, 0.0) is Verdict.REJECT for i in range(4000))
    assert low <= rejected / 4000 <= high
    assert all(gate.admit(req(i, Band.HIGH), state, 0.0) is Verdict.ADMIT for i in range(200))


def test_gie_flow_strict_priority_fcfs_and_dispatch_while_unsaturated() -> None:
    gate = GieFlowGate()
    assert gate.admit(req(0, Band.LOW), IDLE, 0.0) is Verdict.ADMIT  # nothing queued, not saturated
    order = [(1, Band.LOW), (2, Band.NORMAL), (3, Band.HIGH), (4, Band.LOW), (5, Band.HIGH)]
    for rid, band in order:
        assert gate.admit(req(rid, band), SATURATED, 0.0) is Verdict.QUEUE
    assert gate.queued() == 5
    assert gate.release(SATURATED, 0.010) == []  # saturated and work in flight: everything waits
    # one dispatch per 1 ms tick since the last call (GIE ticks every 1 ms), highest band first
    assert [r.id for r in gate.release(IDLE, 0.012)] == [3, 5]
    assert [r.id for r in gate.release(IDLE, 0.0125)] == [2]  # at least the call's own tick
    assert [r.id for r in gate.release(IDLE, 0.100)] == [1, 4]
    assert gate.queued() == 0


def test_gie_flow_fails_open_when_nothing_runs_and_rejects_when_band_full() -> None:
    gate = GieFlowGate(queue_max=2)
    assert [gate.admit(req(i, Band.LOW), SATURATED, 0.0) for i in range(3)] == [
        Verdict.QUEUE,
        Verdict.QUEUE,
        Verdict.REJECT,
    ]
    assert gate.admit(req(9, Band.HIGH), SATURATED, 0.0) is Verdict.QUEUE  # bands are separate queues
    stuck = cluster((10, 0.9), (10, 0.9), inflight=0)  # stale "saturated" scrape, nothing running
    assert [r.id for r in gate.release(stuck, 0.003)] == [9, 0, 1]


# ---- kvgate --------------------------------------------------------------------------------------


def kvgate(total_seats: int = 10, **overrides: object) -> KvgateGate:
    """A gate whose quota is `total_seats` seats of 1000 tokens on 1 worker (default shares 2/5/3;
    `shares={Band.LOW: 1.0}` puts every seat in the low band's nominal, so no band limit applies)."""
    config = KvgateConfig(
        **{
            "tokens_per_seat": 1000,
            "max_seats": 64,
            "seats_per_worker": total_seats,
            "slo_reject": False,
            "shed_low_after_s": None,
            **overrides,
        }  # type: ignore[arg-type]
    )
    return KvgateGate(PROFILE, 1, config)


ONE = cluster((0, 0.0))


def test_kvgate_counts_seats_and_grants_freed_seats_in_priority_order() -> None:
    gate = kvgate(total_seats=10, shares={Band.LOW: 1.0})  # one band quota: no band limits in the way
    big = req(1, Band.NORMAL, tokens=6000, out=1000)  # 7 seats (1000 tokens each; others 1)
    assert gate.admit(big, ONE, 0.0) is Verdict.ADMIT
    assert gate.admit(req(2, Band.NORMAL, tokens=2000, out=1000), ONE, 0.0) is Verdict.ADMIT  # 3 seats: 10
    assert gate.admit(req(3, Band.LOW, tokens=999), ONE, 0.1) is Verdict.QUEUE
    assert gate.admit(req(4, Band.HIGH, tokens=999), ONE, 0.2) is Verdict.QUEUE
    assert gate.queued() == 2
    gate.on_finish(big, "w0", 1.0)
    assert [r.id for r in gate.release(ONE, 1.0)] == [4, 3]  # high first, both fit in 7 freed seats
    assert gate.queued() == 0 and gate.state.usage().total == 3 + 1 + 1


def test_kvgate_aging_serves_a_long_waiting_low_band_before_fresh_high() -> None:
    gate = kvgate(total_seats=2, shares={Band.LOW: 1.0}, aging_ms=1000)
    first = req(1, Band.NORMAL, tokens=2000)
    assert gate.admit(first, ONE, 0.0) is Verdict.ADMIT
    assert gate.admit(req(2, Band.LOW), ONE, 0.0) is Verdict.QUEUE  # low waits since t=0
    assert gate.admit(req(3, Band.HIGH), ONE, 2.5) is Verdict.QUEUE
    gate.on_finish(first, "w0", 2.6)  # low: 0 + 2 levels of aging = high's 2; tie -> waited longest
    assert [r.id for r in gate.release(ONE, 2.6)][:1] == [2]


def test_kvgate_fair_queue_interleaves_a_flooding_tenant() -> None:
    gate = kvgate(total_seats=1, shares={Band.LOW: 1.0})
    blocker = req(0, Band.NORMAL, tenant="other")
    assert gate.admit(blocker, ONE, 0.0) is Verdict.ADMIT
    for rid in range(1, 6):
        assert gate.admit(req(rid, Band.NORMAL, tenant="flood"), ONE, 0.0) is Verdict.QUEUE
    assert gate.admit(req(6, Band.NORMAL, tenant="small"), ONE, 0.0) is Verdict.QUEUE
    served = []
    last = blocker
    for step in range(1, 4):
        gate.on_finish(last, "w0", float(step))
        (last,) = gate.release(ONE, float(step))
        served.append((last.tenant, last.id))
    assert served == [("flood", 1), ("small", 6), ("flood", 2)]


def test_kvgate_borrowing_high_takes_idle_seats_low_keeps_to_its_share() -> None:
    shares = {Band.HIGH: 0.2, Band.NORMAL: 0.5, Band.LOW: 0.3}
    gate = kvgate(total_seats=10, shares=shares)
    lows = [gate.admit(req(i, Band.LOW), ONE, 0.0) for i in range(4)]
    assert lows == [Verdict.ADMIT] * 3 + [Verdict.QUEUE]  # 3 nominal seats, no borrowing
    highs = [gate.admit(req(10 + i, Band.HIGH), ONE, 0.0) for i in range(8)]
    assert highs == [Verdict.ADMIT] * 7 + [Verdict.QUEUE]  # 2 nominal + 5 borrowed = everything free


def test_kvgate_queue_limit_from_expected_qps_times_acceptable_wait() -> None:
    gate = kvgate(
        total_seats=1,
        shares={Band.LOW: 1.0},
        wait_s={Band.HIGH: 1.0, Band.NORMAL: 1.0, Band.LOW: 1.0},
        qps_window_s=10.0,
    )
    assert gate.admit(req(0, Band.LOW), ONE, 0.0) is Verdict.ADMIT  # the low band's only seat
    # 2 then 3 low arrivals in the 10 s window -> 0.2 / 0.3 req/s x 1 s -> limit 1 waiter
    assert gate.admit(req(1, Band.LOW), ONE, 0.0) is Verdict.QUEUE
    assert gate.admit(req(2, Band.LOW), ONE, 0.0) is Verdict.REJECT


def test_kvgate_wait_budget_is_the_slo_then_the_waiter_leaves() -> None:
    gate = kvgate(total_seats=1, shares={Band.LOW: 1.0})
    holder = req(0, Band.HIGH)
    assert gate.admit(holder, ONE, 0.0) is Verdict.ADMIT
    assert gate.admit(req(1, Band.HIGH, slo=2.0), ONE, 0.0) is Verdict.QUEUE
    assert gate.release(ONE, 1.9) == [] and gate.dropped == []
    assert gate.release(ONE, 2.0) == [] and gate.dropped == [1] and gate.queued() == 0


def test_kvgate_slo_aware_early_rejection() -> None:
    gate = kvgate(total_seats=100, slo_reject=True)
    busy = HandCluster(ONE.scrapes, pending={"w0": 400_000})  # ~10 s of prefill ahead
    assert gate.admit(req(1, Band.HIGH, slo=2.0), busy, 0.0) is Verdict.REJECT
    assert gate.admit(req(2, Band.LOW, slo=60.0), busy, 0.0) is Verdict.ADMIT
    assert gate.admit(req(3, Band.HIGH, slo=2.0), ONE, 0.0) is Verdict.ADMIT


def test_queue_guard_refuses_below_high_on_the_routing_decisions_predicted_wait() -> None:
    gate = QueueGuardGate(PROFILE, max_queue_s=1.0, queue_signal="dispatched")
    busy = {"dispatched-wait": 1.5, "predicted-ttft": 1.6, "queue-wait": 1.5}
    assert gate.refuses(Band.NORMAL, busy) and gate.refuses(Band.LOW, busy)
    assert not gate.refuses(Band.HIGH, busy)  # high is never refused by it
    short_queue_long_miss = {"dispatched-wait": 0.2, "predicted-ttft": 1.2, "queue-wait": 0.2}
    assert not gate.refuses(Band.NORMAL, short_queue_long_miss)
    hit_aware = QueueGuardGate(PROFILE, max_queue_s=1.0, queue_signal="dispatched_ttft")
    assert hit_aware.refuses(Band.NORMAL, short_queue_long_miss)  # its own prefill counts
    assert not gate.refuses(Band.NORMAL, {})  # a router that predicts no wait is never refused
    assert not QueueGuardGate(PROFILE, max_queue_s=0.0).refuses(Band.LOW, busy)  # budget 0: off


def test_queue_guard_refuses_on_the_kvgate_routers_decision_and_the_refused_leave_nothing() -> None:
    # 40 misses of 8k tokens at once on 2 workers: ~0.2 s of prefill each, so the queue passes 1 s
    reqs = [SimRequest(i, 0.001 * i, 8000, 1, (1000 + i,), (8000,), Band.NORMAL, "t") for i in range(40)]
    gate = QueueGuardGate(PROFILE, max_queue_s=1.0, queue_signal="dispatched")
    inner = make_router("kvgate", 1)
    result = simulate(reqs, GatedRouter(inner, gate), PROFILE, 2, gate=gate)
    refused = [r for r in result.records if r.rejected]
    assert 0 < len(refused) < len(reqs)
    assert all(r.first_token_s is None for r in refused)  # never dispatched
    assert inner.decisions == len(reqs)  # type: ignore[attr-defined]  # decided, then refused
    assert sum(r.first_token_s is not None for r in result.records) == len(reqs) - len(refused)
    peers = make_router("round_robin", 1)  # predicts no wait: the guard never refuses it
    assert not any(
        r.rejected for r in simulate(reqs, GatedRouter(peers, gate), PROFILE, 2, gate=gate).records
    )


@pytest.mark.parametrize(
    ("pending_tokens", "granted"),
    [
        pytest.param(0, True, id="idle worker: granted with 1 s of its 2 s SLO left"),
        pytest.param(65_536, False, id="8 chunks of prefill ahead (~1.5 s): would answer late, leaves"),
    ],
)
def test_kvgate_rejects_a_waiter_at_grant_time_when_its_slo_is_out_of_reach(
    pending_tokens: int, granted: bool
) -> None:
    gate = kvgate(total_seats=1, shares={Band.LOW: 1.0}, slo_reject=True)
    live = HandCluster(ONE.scrapes, pending={})  # the gate keeps the cluster it last saw (the sim's one)
    holder = req(0, Band.HIGH)
    assert gate.admit(holder, live, 0.0) is Verdict.ADMIT
    assert gate.admit(req(1, Band.HIGH, slo=2.0), live, 0.0) is Verdict.QUEUE  # ~1 s wait predicted
    live.pending["w0"] = pending_tokens
    gate.on_finish(holder, "w0", 1.0)
    assert [r.id for r in gate.release(live, 1.0)] == ([1] if granted else [])
    assert gate.dropped == ([] if granted else [1]) and gate.queued() == 0
    assert gate.state.usage().total == (1 if granted else 0)


def test_kvgate_sheds_low_first_under_sustained_pressure() -> None:
    gate = kvgate(total_seats=1, shares={Band.NORMAL: 1.0}, shed_low_after_s=1.0)
    assert gate.admit(req(0, Band.NORMAL), ONE, 0.0) is Verdict.ADMIT
    assert gate.admit(req(1, Band.NORMAL), ONE, 0.0) is Verdict.QUEUE  # pressure starts
    assert gate.admit(req(2, Band.LOW), ONE, 0.5) is Verdict.QUEUE
    assert gate.admit(req(3, Band.LOW), ONE, 1.0) is Verdict.REJECT  # 1 s of waiters above LOW
    assert gate.admit(req(4, Band.HIGH), ONE, 1.0) is Verdict.QUEUE


def test_kvgate_prefill_headroom_holds_lower_bands_only() -> None:
    gate = kvgate(total_seats=100, prefill_budget_tokens=8192)
    busy = HandCluster(ONE.scrapes, pending={"w0": 10_000})
    assert gate.admit(req(1, Band.NORMAL), busy, 0.0) is Verdict.QUEUE
    assert gate.admit(req(2, Band.HIGH), busy, 0.0) is Verdict.ADMIT
    assert [r.id for r in gate.release(ONE, 0.1)] == [1]


def test_kvgate_prefill_budget_counts_requests_granted_in_the_same_pump() -> None:
    gate = kvgate(total_seats=100, prefill_budget_tokens=8192)
    held = req(0, Band.HIGH, tokens=999)
    gate.admit(held, ONE, 0.0)
    busy = HandCluster(ONE.scrapes, pending={"w0": 10_000})
    for rid in range(1, 6):  # 5 x 3000 prompt tokens queue behind the busy cluster
        assert gate.admit(req(rid, Band.NORMAL, tokens=3000), busy, 0.0) is Verdict.QUEUE
    gate.on_finish(held, "w0", 0.1)
    # the cluster's prefill drained: grants stop once the granted prompts (not yet dispatched) fill it
    assert [r.id for r in gate.release(ONE, 0.1)] == [1, 2, 3]
    assert [r.id for r in gate.release(HandCluster(ONE.scrapes, pending={"w0": 9000}), 0.2)] == []


def test_kvgate_prefill_budget_asks_for_a_release_at_first_tokens() -> None:
    assert kvgate(prefill_budget_tokens=8192).release_on_first_token
    assert not kvgate().release_on_first_token  # only seats free at finishes


def test_kvgate_prefill_is_the_default_gate_plus_a_budget_per_worker() -> None:
    named = make_gate("kvgate_prefill", PROFILE, 8, 1)
    assert isinstance(named, KvgateGate)
    assert named.config == KvgateConfig(prefill_budget_tokens=8 * PREFILL_BUDGET_PER_WORKER)


def test_registry_names_are_the_stable_interface() -> None:
    assert list(GATES) == [
        "none",
        "gie_shed",
        "gie_flow",
        "probabilistic",
        "kvgate",
        "kvgate_prefill",
        "kvgate_guard",
    ]
    assert resolve_admissions("all") == list(GATES)
    assert resolve_admissions("kvgate, none,kvgate") == ["kvgate", "none"]
    with pytest.raises(UnknownAdmission, match="known: none"):
        resolve_admissions("nope")
    for name in GATES:
        assert make_gate(name, PROFILE, 2, 1).name == name


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(Band)),
            st.sampled_from(["a", "b", "flood"]),
            st.integers(1, 9000),
            st.booleans(),  # finish one running request after this arrival
        ),
        min_size=1,
        max_size=60,
    )
)
def test_kvgate_never_exceeds_quota_and_accounts_for_every_request(
    ops: list[tuple[Band, str, int, bool]],
) -> None:
    gate = kvgate(total_seats=12, slo_reject=True, shed_low_after_s=0.5, aging_ms=300)
    nominal_low = gate.quota.band[Band.LOW]
    running: list[SimRequest] = []
    rejected: set[int] = set()
    finished = 0
    now = 0.0
    for rid, (band, tenant, tokens, finish) in enumerate(ops):
        now += 0.1
        r = req(rid, band, tenant, tokens=tokens, slo=3.0 if band == Band.HIGH else None)
        verdict = gate.admit(r, ONE, now)
        if verdict is Verdict.ADMIT:
            running.append(r)
        elif verdict is Verdict.REJECT:
            rejected.add(rid)
        if finish and running:
            gate.on_finish(running.pop(0), "w0", now)
            finished += 1
        running.extend(gate.release(ONE, now))
        usage = gate.state.usage()
        assert usage.total <= 12 and usage.band.get(Band.LOW, 0) <= nominal_low
        assert usage.total == sum(lease.seats for lease in gate.state.leases.values())
    # every request is in exactly one place: held, waiting/ready, refused at the door, or timed out
    leases, waiters = {int(rid) for rid in gate.state.leases}, {int(rid) for rid in gate.state.waiters}
    places = [leases, waiters | {r.id for r in gate.ready}, rejected, set(gate.dropped)]
    assert sum(len(p) for p in places) == len(set().union(*places))
    assert sum(len(p) for p in places) + finished == len(ops)
    assert {r.id for r in running} == leases


def test_kvgate_gate_runs_the_quota_an_operator_gets_by_default() -> None:
    """`--admission kvgate` uses policy/admission.py's defaults: default_quota's shares and borrowing,
    4096-token seats (at most 16), a worker's KV capacity in seats; no scenario-specific settings."""
    gate = KvgateGate(PROFILE, 8)
    per_worker = PROFILE.capacity_tokens // DEFAULT_TOKENS_PER_SEAT
    assert gate.quota == default_quota(8, per_worker)
    assert (gate.config.tokens_per_seat, gate.config.max_seats) == (
        DEFAULT_TOKENS_PER_SEAT,
        DEFAULT_MAX_SEATS,
    )
