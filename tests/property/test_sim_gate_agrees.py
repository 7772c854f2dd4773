"""The simulator's kvgate gate grants exactly what policy.admission.AdmissionState grants.

With the simulator-only settings off (SLO re-checks, low shedding, queue limits from the measured
rate, the prefill budget), random arrivals, finishes and clock steps go to both the gate, through
the simulator's interface (admit / on_finish / release, on a real SimCluster), and a bare
`AdmissionState` driven the way the gateway drives the Lua scripts (acquire, release, check). After
every step the verdicts, the requests granted, the requests that left their queue, the seat counts
and the queues must be equal. tests/property/test_admission_agrees.py holds AdmissionState to the
Lua scripts, so the simulator and the gateway run the same admission rules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sim.admission import LEASE_MS, KvgateConfig, KvgateGate, sim_rid
from bench.sim.cluster import SimCluster, Verdict
from bench.sim.profiles import load_profile
from bench.sim.types import SimRequest
from policy.admission import AdmissionState, AdmitCode, default_quota, seat_count
from policy.types import Band

PROFILE = load_profile("h100-llama3.1-8b")
TENANTS = ["acme", "bolt", "flood"]


@dataclass(frozen=True)
class Arrive:
    band: Band
    tenant: str
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Finish:
    pick: int  # index into the running requests, modulo their number


@dataclass(frozen=True)
class Tick:
    ms: int


arrivals = st.builds(
    Arrive, st.sampled_from(list(Band)), st.sampled_from(TENANTS), st.integers(1, 9000), st.integers(1, 3000)
)
steps = st.one_of(
    arrivals,
    arrivals,  # mostly arrivals: the queues fill, and the grant order is what gets compared
    st.builds(Finish, st.integers(0, 50)),
    st.builds(Tick, st.sampled_from([0, 10, 100, 500, 1000, 3000]) | st.integers(0, 3000)),
)
configs = st.builds(
    KvgateConfig,
    tokens_per_seat=st.sampled_from([0, 1000, 1000, 4096]),
    max_seats=st.integers(1, 16),
    seats_per_worker=st.integers(1, 8),
    shares=st.sampled_from(
        [
            {Band.HIGH: 0.5, Band.NORMAL: 0.3, Band.LOW: 0.2},
            {Band.HIGH: 0.2, Band.NORMAL: 0.6, Band.LOW: 0.2},
            {Band.LOW: 1.0},
        ]
    ),
    aging_ms=st.sampled_from([0, 300, 5000]),
    wait_s=st.fixed_dictionaries({b: st.sampled_from([0.05, 0.3, 1.0, 5.0]) for b in Band}),
    # the simulator-only settings, off
    qps_window_s=st.just(0.0),
    slo_reject=st.just(False),
    shed_low_after_s=st.none(),
    prefill_budget_tokens=st.none(),
)


@settings(max_examples=200, deadline=None)
@given(configs, st.integers(1, 2), st.integers(1, 8), st.lists(steps, min_size=8, max_size=80))
def test_the_simulators_gate_grants_what_admission_state_grants(
    config: KvgateConfig, workers: int, queue_max: int, ops: list[object]
) -> None:
    gate = KvgateGate(PROFILE, workers, config)
    quota = replace(
        default_quota(workers, config.seats_per_worker or 1, config.shares),
        aging_ms=config.aging_ms,
        queue_max=queue_max,
    )
    gate.quota = quota  # the gateway's static queue length, set as an operator would
    ref = AdmissionState(quota)
    cluster = SimCluster(PROFILE, workers)  # idle engines: nothing cached, no prefill pending
    now_ms, next_id = 0, 0
    running: list[SimRequest] = []
    waiting: set[str] = set()
    for op in ops:
        now_s = now_ms / 1000
        dropped_before = len(gate.dropped)
        match op:
            case Arrive(band, tenant, input_tokens, output_tokens):
                req = SimRequest(
                    next_id, now_s, input_tokens, output_tokens, (next_id,), (input_tokens,), band, tenant
                )
                next_id += 1
                seats = seat_count(input_tokens, output_tokens, config.tokens_per_seat, config.max_seats)
                wait_ms = round(config.wait_s[band] * 1000)
                expected = ref.acquire(now_ms, sim_rid(req.id), band, tenant, seats, LEASE_MS, wait_ms)
                verdict = gate.admit(req, cluster, now_s)
                assert (
                    verdict
                    is {
                        AdmitCode.ADMITTED: Verdict.ADMIT,
                        AdmitCode.QUEUED: Verdict.QUEUE,
                        AdmitCode.QUEUE_FULL: Verdict.REJECT,
                    }[expected.code]
                )
                ref_granted = list(expected.granted)
                if verdict is Verdict.ADMIT:
                    running.append(req)
                elif verdict is Verdict.QUEUE:
                    waiting.add(sim_rid(req.id))
            case Finish(pick) if running:
                done = running.pop(pick % len(running))
                ref_granted = list(ref.release(now_ms, sim_rid(done.id)).granted)
                gate.on_finish(done, "w0", now_s)
            case Finish():
                continue
            case Tick(ms):
                now_ms += ms
                ref_granted = list(ref.check(now_ms, "nobody").granted)
        released = list(gate.release(cluster, now_ms / 1000))
        assert [sim_rid(r.id) for r in released] == ref_granted
        running.extend(released)
        waiting -= set(ref_granted)
        ref_left = waiting - set(ref.waiters)  # wait budget spent: the deadline reaped them
        assert {sim_rid(rid) for rid in gate.dropped[dropped_before:]} == ref_left
        waiting -= ref_left
        assert gate.state.usage() == ref.usage()
        assert [gate.state.queue(b) for b in Band] == [ref.queue(b) for b in Band]
