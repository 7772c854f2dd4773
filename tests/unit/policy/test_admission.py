"""policy.admission: the pure rules (seats, limits, borrowing, fair order, aging) and the state machine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.admission import (
    AdmissionHooks,
    AdmissionState,
    AdmitCode,
    CheckStatus,
    Quota,
    ReleaseCode,
    Usage,
    band_ok,
    clamp_seats,
    default_quota,
    effective_priority,
    estimated_wait_s,
    fair_tag,
    max_band_wait_ms,
    queue_limit,
    queue_too_deep,
    seat_count,
    tenant_ok,
)
from policy.types import Band

H, N, L = Band.HIGH, Band.NORMAL, Band.LOW


# ---- config first -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "per_worker", "total", "bands"),
    [
        pytest.param(4, 8, 32, {H: 17, N: 9, L: 6}, id="4x8: shares 50/30/20, rounding to high"),
        pytest.param(1, 1, 1, {H: 1, N: 0, L: 0}, id="one slot goes to the online band"),
        pytest.param(0, 8, 1, {H: 1, N: 0, L: 0}, id="no workers still admits one"),
    ],
)
def test_default_quota_from_capacity(
    workers: int, per_worker: int, total: int, bands: dict[Band, int]
) -> None:
    quota = default_quota(workers, per_worker)
    assert quota.total == total
    assert dict(quota.band) == bands
    assert quota.borrow[L] == 0 and quota.borrow[H] == total


def test_quota_hash_absent_fields_mean_unlimited_and_defaults() -> None:
    assert Quota.from_hash({}) == Quota()
    assert Quota.from_hash({"aging_ms": "0", "seats": "0"}) == Quota(aging_ms=0, count_seats=False)


# ---- seats ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uncached", "max_tokens", "per_seat", "max_seats", "seats"),
    [
        pytest.param(1000, 256, 4096, 16, 1, id="plain request is 1 seat"),
        pytest.param(0, 0, 4096, 16, 1, id="empty request still 1 seat"),
        pytest.param(4096, 1, 4096, 16, 2, id="just over one seat rounds up"),
        pytest.param(100_000, 1000, 4096, 16, 16, id="huge prompt capped at max_seats"),
        pytest.param(100_000, 1000, 0, 16, 1, id="seats off counts requests"),
        pytest.param(-5, 10, 4096, 16, 1, id="negative counts are ignored"),
    ],
)
def test_seat_count(uncached: int, max_tokens: int, per_seat: int, max_seats: int, seats: int) -> None:
    assert seat_count(uncached, max_tokens, per_seat, max_seats) == seats


@pytest.mark.parametrize(
    ("seats", "quota", "band", "expected"),
    [
        pytest.param(5, Quota(), N, 5, id="unlimited keeps the count"),
        pytest.param(9, Quota(total=4), N, 4, id="never above the model total"),
        pytest.param(9, Quota(tenant=3), N, 3, id="never above the tenant cap"),
        pytest.param(9, Quota(band={H: 2}, borrow={H: 1}), H, 3, id="band nominal plus borrow"),
        pytest.param(9, Quota(total=0), N, 9, id="a zero limit does not clamp"),
        pytest.param(9, Quota(total=6, reserve={H: 2}), N, 4, id="never above what a higher reserve leaves"),
        pytest.param(9, Quota(total=6, reserve={H: 2}), H, 6, id="a band's own reserve does not clamp it"),
        pytest.param(0, Quota(), N, 1, id="at least one"),
        pytest.param(9, Quota(count_seats=False), N, 1, id="seats off"),
    ],
)
def test_clamp_seats(seats: int, quota: Quota, band: Band, expected: int) -> None:
    assert clamp_seats(seats, quota, band, "t") == expected


# ---- limits and borrowing ---------------------------------------------------------------------


BORROW = Quota(total=10, band={H: 4, N: 3, L: 3}, borrow={H: 3})


@pytest.mark.parametrize(
    ("usage", "band", "seats", "ok"),
    [
        pytest.param(Usage(band={H: 3}), H, 1, True, id="within nominal"),
        pytest.param(Usage(band={H: 4}), H, 1, True, id="borrows unused lower seats"),
        pytest.param(Usage(band={H: 7}), H, 1, False, id="borrow ceiling reached"),
        pytest.param(Usage(band={H: 4, N: 3, L: 2}), H, 1, True, id="borrows the one unused low seat"),
        pytest.param(Usage(band={H: 5, N: 3, L: 2}), H, 1, False, id="nothing left to borrow"),
        pytest.param(Usage(band={L: 3}), L, 1, False, id="low has no borrow allowance"),
        pytest.param(Usage(band={H: 7}), L, 1, True, id="lender may still use its own nominal"),
        pytest.param(Usage(), H, 8, False, id="a request larger than nominal+borrow"),
    ],
)
def test_band_ok_with_borrowing(usage: Usage, band: Band, seats: int, ok: bool) -> None:
    assert band_ok(BORROW, usage, band, seats) is ok


RESERVE = Quota(total=10, band={H: 5, L: 5}, borrow={H: 5}, reserve={H: 2, N: 1})


@pytest.mark.parametrize(
    ("usage", "band", "seats", "ok"),
    [
        pytest.param(Usage(total=7, band={L: 4, H: 3}), L, 1, True, id="low leaves the high reserve free"),
        pytest.param(Usage(total=8, band={L: 4, H: 4}), L, 1, False, id="low may not take the high reserve"),
        pytest.param(Usage(total=8, band={L: 4, H: 4}), H, 2, True, id="high takes its own reserve"),
        pytest.param(Usage(total=7, band={L: 4, N: 3}), N, 1, True, id="normal leaves the high reserve free"),
        pytest.param(Usage(total=8, band={L: 4, N: 4}), N, 1, False, id="normal may not take it either"),
        pytest.param(Usage(total=2, band={L: 2}), L, 3, True, id="reserve is free while the total is not"),
        pytest.param(Usage(total=0), L, 6, False, id="nominal still applies"),
    ],
)
def test_band_ok_keeps_a_higher_bands_reserve_free(usage: Usage, band: Band, seats: int, ok: bool) -> None:
    assert band_ok(RESERVE, usage, band, seats) is ok


def test_reserve_without_a_total_is_ignored() -> None:
    assert band_ok(Quota(reserve={H: 5}), Usage(total=100), L, 1)


@pytest.mark.parametrize(
    ("quota", "used", "ok"),
    [
        pytest.param(Quota(tenant=2), 1, True, id="under default cap"),
        pytest.param(Quota(tenant=2), 2, False, id="at default cap"),
        pytest.param(Quota(tenant=2, tenants={"t": 5}), 4, True, id="override raises the cap"),
        pytest.param(Quota(), 10**6, True, id="no cap"),
    ],
)
def test_tenant_ok(quota: Quota, used: int, ok: bool) -> None:
    assert tenant_ok(quota, Usage(tenant={"t": used}), "t", 1) is ok


# ---- order, aging, estimates ------------------------------------------------------------------


def test_fair_tag_spaces_a_tenants_requests_and_restarts_idle_tenants_at_vtime() -> None:
    assert fair_tag(vtime=10, tenant_last_tag=None, seats=1) == 11
    assert fair_tag(vtime=10, tenant_last_tag=15, seats=2) == 17
    assert fair_tag(vtime=10, tenant_last_tag=3, seats=1) == 11


@pytest.mark.parametrize(
    ("band", "waited_ms", "aging_ms", "priority"),
    [
        pytest.param(L, 0, 1000, 0, id="fresh"),
        pytest.param(L, 1999, 1000, 1, id="one whole period"),
        pytest.param(L, 2000, 1000, 2, id="low reaches high after two periods"),
        pytest.param(L, 10**6, 0, 0, id="aging off"),
    ],
)
def test_effective_priority(band: Band, waited_ms: int, aging_ms: int, priority: int) -> None:
    assert effective_priority(band, 0, waited_ms, aging_ms) == priority


def test_max_band_wait_and_queue_limit_and_estimate() -> None:
    assert max_band_wait_ms(L, 5000) == 15000 and max_band_wait_ms(H, 5000) == 5000
    assert max_band_wait_ms(L, 0) is None
    assert queue_limit(200, 2) == 400  # the article's example
    assert queue_limit(0.1, 1) == 1
    assert estimated_wait_s(ahead=9, capacity_seats=5, mean_hold_s=2.0) == pytest.approx(4.0)
    assert estimated_wait_s(ahead=1, capacity_seats=-1, mean_hold_s=2.0) == 2.0


# ---- the state machine ------------------------------------------------------------------------


def acquire(s: AdmissionState, now: int, rid: str, band: Band = N, tenant: str = "t", seats: int = 1,
            wait: int = 60_000) -> AdmitCode:  # fmt: skip
    return s.acquire(now, rid, band, tenant, seats, lease_ms=10_000, max_wait_ms=wait).code


def test_admit_queue_reject_release() -> None:
    s = AdmissionState(Quota(total=1, queue_max=1))
    assert acquire(s, 0, "a") == AdmitCode.ADMITTED
    assert acquire(s, 0, "a") == AdmitCode.ALREADY_HELD
    assert acquire(s, 0, "b") == AdmitCode.QUEUED
    assert acquire(s, 0, "b") == AdmitCode.ALREADY_QUEUED
    assert acquire(s, 0, "c") == AdmitCode.QUEUE_FULL
    assert acquire(s, 0, "d", wait=0) == AdmitCode.NO_SEAT
    assert s.release(5, "a").granted == ("b",)
    assert s.release(5, "a").code == ReleaseCode.UNKNOWN
    assert s.check(5, "b").status == CheckStatus.HELD


def test_expired_leases_stop_counting_and_expired_waiters_leave() -> None:
    s = AdmissionState(Quota(total=1))
    s.acquire(0, "a", N, "t", 1, lease_ms=100, max_wait_ms=0)
    assert acquire(s, 50, "b", wait=20) == AdmitCode.QUEUED
    assert s.check(70, "b").status == CheckStatus.GONE  # its wait budget ended at 70
    assert acquire(s, 100, "c") == AdmitCode.ADMITTED  # a's lease expired at 100
    assert s.renew(150, ["a", "c"], 1000)[0] == ("a",)


def test_strict_priority_between_bands_without_aging() -> None:
    s = AdmissionState(Quota(total=1, aging_ms=0))
    acquire(s, 0, "run")
    for rid, band in [("low", L), ("normal", N), ("high", H)]:
        assert acquire(s, 1, rid, band) == AdmitCode.QUEUED
    order = [s.release(10 * i, rid).granted[0] for i, rid in enumerate(["run", "high", "normal"], 1)]
    assert order == ["high", "normal", "low"]


def test_aging_serves_a_starved_low_band_within_its_bound() -> None:
    s = AdmissionState(Quota(total=1, aging_ms=1000))
    acquire(s, 0, "h0", H)
    acquire(s, 0, "low", L)
    served_at = None
    for i in range(1, 10):  # a steady high stream that alone would starve the low band
        now = i * 500
        acquire(s, now, f"h{i}", H)
        if "low" in s.release(now, f"h{i - 1}").granted:
            served_at = now
            break
    assert served_at is not None
    bound = max_band_wait_ms(L, 1000)
    assert bound is not None and served_at <= bound


def test_a_tenants_flood_does_not_take_the_band() -> None:
    s = AdmissionState(Quota(total=1))
    acquire(s, 0, "run")
    for i in range(5):
        acquire(s, 0, f"flood{i}", tenant="flood")
    acquire(s, 1, "polite0", tenant="polite")
    acquire(s, 1, "polite1", tenant="polite")
    order = []
    current = "run"
    for t in range(2, 10):
        granted = s.release(t, current).granted
        if not granted:
            break
        current = granted[0]
        order.append(current)
    assert order[:4] == ["flood0", "polite0", "flood1", "polite1"]


def test_a_big_request_is_not_starved_by_small_ones_behind_it() -> None:
    s = AdmissionState(Quota(total=4))
    for i in range(3):
        acquire(s, 0, f"small{i}")
    assert acquire(s, 0, "big", seats=4) == AdmitCode.QUEUED
    assert acquire(s, 0, "later") == AdmitCode.QUEUED  # 1 seat is free, but big is first in line
    s.release(1, "small0")
    s.release(1, "small1")
    assert s.release(1, "small2").granted == ("big",)


def test_a_high_burst_finds_reserved_seats_while_low_waits() -> None:
    s = AdmissionState(Quota(total=4, band={H: 2, L: 2}, borrow={H: 2}, reserve={H: 1}))
    assert [acquire(s, 0, f"h{i}", H) for i in range(2)] == [AdmitCode.ADMITTED] * 2
    assert acquire(s, 0, "low0", L) == AdmitCode.ADMITTED
    assert acquire(s, 0, "low1", L) == AdmitCode.QUEUED  # within low's nominal, but the last seat is high's
    assert acquire(s, 1, "h2", H) == AdmitCode.ADMITTED  # at once, ahead of the waiting low request
    assert s.release(2, "h0").granted == ()  # the freed seat is the reserve again: low keeps waiting
    assert s.release(3, "h1").granted == ("low1",)


def test_a_tenant_at_its_cap_does_not_block_other_tenants() -> None:
    s = AdmissionState(Quota(total=4, tenant=1))
    acquire(s, 0, "a1", tenant="a")
    assert acquire(s, 0, "a2", tenant="a") == AdmitCode.QUEUED
    assert acquire(s, 0, "b1", tenant="b") == AdmitCode.ADMITTED


def test_cancelled_waiter_leaves_and_tag_is_restored_on_reject() -> None:
    s = AdmissionState(Quota(total=1, queue_max=1))
    acquire(s, 0, "run")
    acquire(s, 0, "w", tenant="x")
    assert s.release(1, "w").code == ReleaseCode.LEFT_QUEUE
    assert s.waiters == {}


# ---- properties -------------------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "release", "tick"]),
        st.integers(0, 7),
        st.sampled_from(list(Band)),
        st.sampled_from(["a", "b"]),
        st.integers(1, 4),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    quota=st.builds(
        Quota,
        total=st.none() | st.integers(1, 6),
        band=st.dictionaries(st.sampled_from(list(Band)), st.integers(0, 4)),
        borrow=st.dictionaries(st.sampled_from(list(Band)), st.integers(0, 3)),
        reserve=st.dictionaries(st.sampled_from(list(Band)), st.integers(0, 3)),
        tenant=st.none() | st.integers(1, 4),
    ),
    steps=ops,
)
def test_usage_never_exceeds_any_limit(quota: Quota, steps: list[tuple[str, int, Band, str, int]]) -> None:
    s = AdmissionState(quota)
    now = 0
    for op, i, band, tenant, seats in steps:
        if op == "tick":
            now += 100 * seats
        elif op == "acquire":
            s.acquire(now, f"r{i}", band, tenant, seats, lease_ms=300, max_wait_ms=1000)
        else:
            s.release(now, f"r{i}")
        u = s.usage()
        assert quota.total is None or u.total <= quota.total
        assert quota.tenant is None or all(v <= quota.tenant for v in u.tenant.values())
        for b, nominal in quota.band.items():
            assert u.band.get(b, 0) <= nominal + quota.borrow.get(b, 0)


class _Hooks(AdmissionHooks):
    """Holds the low band, refuses one id at grant and one wait, and records what it observes."""

    def __init__(self) -> None:
        self.low_open = False
        self.events: list[tuple[str, str]] = []

    def band_open(self, band: Band, now_ms: int) -> bool:
        return band != Band.LOW or self.low_open

    def still_wanted(self, rid: str, now_ms: int) -> bool:
        return rid != "late"

    def accepts_wait(self, rid: str, est_wait_s: float) -> bool:
        return rid != "impatient"

    def granted(self, rid: str, now_ms: int) -> None:
        self.events.append(("granted", rid))

    def dropped(self, rid: str, now_ms: int) -> None:
        self.events.append(("dropped", rid))


def test_hooks_hold_a_band_refuse_at_grant_and_refuse_a_wait() -> None:
    hooks = _Hooks()
    state = AdmissionState(Quota(total=1), hooks=hooks)
    assert state.acquire(0, "low", Band.LOW, "t", 1, 1000, 5000).code is AdmitCode.QUEUED  # band held
    assert state.acquire(0, "late", Band.HIGH, "t", 1, 1000, 5000).code is AdmitCode.WAIT_REFUSED
    assert state.acquire(0, "high", Band.HIGH, "t", 1, 1000, 5000).code is AdmitCode.ADMITTED
    refused = state.acquire(0, "impatient", Band.NORMAL, "u", 1, 1000, 5000)
    assert refused.code is AdmitCode.WAIT_REFUSED and "u" not in state.tags.get(Band.NORMAL, {})
    hooks.low_open = True
    assert state.release(10, "high").granted == ("low",)
    assert hooks.events == [("dropped", "late"), ("granted", "high"), ("granted", "low")]


def test_a_waiter_whose_budget_runs_out_is_reported_dropped() -> None:
    hooks = _Hooks()
    state = AdmissionState(Quota(total=1), hooks=hooks)
    state.acquire(0, "a", Band.HIGH, "t", 1, 10_000, 5000)
    assert state.acquire(0, "b", Band.HIGH, "t", 1, 10_000, 100).code is AdmitCode.QUEUED
    assert state.pump(100) == () and ("dropped", "b") in hooks.events and "b" not in state.waiters


@pytest.mark.parametrize(
    ("band", "wait_s", "max_queue_s", "refused"),
    [
        (Band.NORMAL, 1.01, 1.0, True),
        (Band.LOW, 1.01, 1.0, True),
        (Band.NORMAL, 1.0, 1.0, False),  # at the budget: still sent
        (Band.HIGH, 60.0, 1.0, False),  # high is never refused by the guard
        (Band.LOW, 60.0, 0.0, False),  # 0 = off
    ],
)
def test_queue_too_deep(band: Band, wait_s: float, max_queue_s: float, refused: bool) -> None:
    assert queue_too_deep(band, wait_s, max_queue_s) is refused
