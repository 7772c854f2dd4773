"""The event loop on real engines: event order, R/M signals as routers see them, determinism."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from bench.sim.baselines import LeastInflight, RoundRobin
from bench.sim.cluster import (
    PHASE_ARRIVAL,
    PHASE_ENGINE,
    PHASE_SCRAPE,
    SimCluster,
    Verdict,
    event_key,
    simulate,
)
from bench.sim.load import scale_to_load
from bench.sim.profiles import load_profile
from bench.sim.scenarios import build_scenario
from bench.sim.types import ClusterView, NoFeedback, SimRequest

PROFILE = load_profile("h100-llama3.1-8b")


def req(i: int, at: float, ids: tuple[int, ...] = (), inp: int = 2048, out: int = 20) -> SimRequest:
    ids = ids or (1000 + i,)
    tokens = [512] * (len(ids) - 1)
    tokens.append(inp - 512 * (len(ids) - 1))
    return SimRequest(i, at, inp, out, ids, tuple(tokens))


@pytest.mark.parametrize(
    ("earlier", "later"),
    [
        pytest.param(event_key(1.0, PHASE_ARRIVAL, 0), event_key(2.0, PHASE_ENGINE, 0), id="time first"),
        pytest.param(
            event_key(1.0, PHASE_ENGINE, 9), event_key(1.0, PHASE_SCRAPE, 0), id="engine before scrape"
        ),
        pytest.param(
            event_key(1.0, PHASE_SCRAPE, 9), event_key(1.0, PHASE_ARRIVAL, 0), id="scrape before arrival"
        ),
        pytest.param(
            event_key(1.0, PHASE_ARRIVAL, 3), event_key(1.0, PHASE_ARRIVAL, 4), id="then creation order"
        ),
    ],
)
def test_event_key_order(earlier: tuple[float, int, int], later: tuple[float, int, int]) -> None:
    assert earlier < later


class Spy(NoFeedback):
    """Routes round-robin and records what it saw; checks the hooks against its own bookkeeping."""

    name = "spy"

    def __init__(self) -> None:
        self.inner = RoundRobin()
        self.seen: list[tuple[float, dict[str, int], dict[str, float], dict[str, int]]] = []
        self.mine: dict[str, int] = {}
        self.hook_times: list[float] = []

    def route(self, r: SimRequest, cluster: ClusterView, now_s: float) -> str:
        ids = cluster.worker_ids
        self.seen.append(
            (
                now_s,
                {w: cluster.inflight(w) for w in ids},
                {w: cluster.scraped(w).at_s for w in ids},
                {w: cluster.pending_prefill_tokens(w) for w in ids},
            )
        )
        assert {w: cluster.inflight(w) for w in ids} == {w: self.mine.get(w, 0) for w in ids}
        views = cluster.worker_views(now_s)
        assert [v.id for v in views] == list(ids)
        assert all(v.capacity_tokens == PROFILE.capacity_tokens for v in views)
        worker = self.inner.route(r, cluster, now_s)
        self.mine[worker] = self.mine.get(worker, 0) + 1
        return worker

    def on_first_token(self, r: SimRequest, worker_id: str, now_s: float) -> None:
        self.hook_times.append(now_s)

    def on_finish(self, r: SimRequest, worker_id: str, now_s: float) -> None:
        self.mine[worker_id] -= 1
        self.hook_times.append(now_s)


def test_signals_seen_by_the_router() -> None:
    reqs = [req(i, 0.013 * i) for i in range(60)]
    spy = Spy()
    result = simulate(reqs, spy, PROFILE, 3, scrape_period_s=0.05)
    assert all(r.finish_s is not None for r in result.records)
    for now, _, scraped_at, _ in spy.seen:
        assert all(at == math.floor(now / 0.05) * 0.05 for at in scraped_at.values())
    assert spy.hook_times == sorted(spy.hook_times)  # hooks in virtual-time order across workers
    assert spy.seen[0][3] == {"w0": 0, "w1": 0, "w2": 0}
    assert spy.seen[1][3]["w0"] == 2048  # w0's prompt is still prefilling 13 ms later
    assert result.scrapes == len({math.floor(r.arrival_s / 0.05) for r in reqs})


def test_finish_at_the_arrival_instant_is_seen_by_that_arrival() -> None:
    alone = simulate([req(0, 0.0)], RoundRobin(), PROFILE, 1)
    finish = alone.records[0].finish_s
    assert finish is not None
    spy = Spy()
    simulate([req(0, 0.0), req(1, finish)], spy, PROFILE, 1)
    assert spy.seen[1][1] == {"w0": 0}  # ENGINE phase runs before ARRIVAL at the same time


class UsageSpy(Spy):
    """Records each usage report: (request id, when, cached tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.usage: list[tuple[int, float, int]] = []

    def on_usage(self, r: SimRequest, worker_id: str, cached_tokens: int, now_s: float) -> None:
        self.usage.append((r.id, now_s, cached_tokens))


def test_usage_comes_with_the_responses_end_and_the_engines_cached_tokens() -> None:
    shared = (1, 2, 3, 4)
    reqs = [req(0, 0.0, (*shared, 10), inp=2300), req(1, 5.0, (*shared, 11), inp=2300)]
    spy = UsageSpy()
    result = simulate(reqs, spy, PROFILE, 1)
    assert spy.usage == [
        (r.id, r.finish_s, r.cached_tokens) for r in result.records
    ]  # at the end, not the first token
    assert spy.usage[1][2] == 4 * 512  # the second request hit the shared blocks


def test_cache_hits_come_from_the_engine() -> None:
    shared = (1, 2, 3, 4)
    reqs = [req(0, 0.0, (*shared, 10), inp=2300), req(1, 5.0, (*shared, 11), inp=2300)]
    result = simulate(reqs, RoundRobin(), PROFILE, 1)
    assert [r.cached_tokens for r in result.records] == [0, 2048]
    assert result.prefix_cache_hits["w0"] == 2048


def test_cluster_view_reports_cached_prefix_blocks() -> None:
    cluster = SimCluster(PROFILE, 2)
    assert cluster.cached_prefix_blocks("w0", req(0, 0.0, (1, 2))) == 0
    assert cluster.capacity_tokens("w1") == PROFILE.capacity_tokens
    assert cluster.max_concurrency("w1") == PROFILE.max_num_seqs


def test_unknown_worker_from_a_router_is_an_error() -> None:
    class Bad(RoundRobin):
        name = "bad"

        def route(self, r: SimRequest, cluster: ClusterView, now_s: float) -> str:
            return "nope"

    with pytest.raises(ValueError, match="unknown worker 'nope'"):
        simulate([req(0, 0.0)], Bad(), PROFILE, 1)


def records_of(reqs: Sequence[SimRequest]) -> list[tuple[object, ...]]:
    result = simulate(reqs, LeastInflight(), PROFILE, 4)
    return [(r.worker, r.first_token_s, r.finish_s, r.cached_tokens) for r in result.records]


def test_same_input_same_run() -> None:
    reqs = build_scenario("multi_turn", seed=5, limit=150)
    assert records_of(reqs) == records_of(reqs)


class CapGate:
    """At most `cap` requests dispatched at once cluster-wide; the rest wait FIFO; ids in `reject` get 429."""

    def __init__(self, cap: int, reject: set[int]) -> None:
        self.cap, self.reject = cap, reject
        self.held: list[SimRequest] = []

    def _inflight(self, cluster: ClusterView) -> int:
        return sum(cluster.inflight(w) for w in cluster.worker_ids)

    def admit(self, r: SimRequest, cluster: ClusterView, now_s: float) -> Verdict:
        if r.id in self.reject:
            return Verdict.REJECT
        if self._inflight(cluster) >= self.cap or self.held:
            self.held.append(r)
            return Verdict.QUEUE
        return Verdict.ADMIT

    def release(self, cluster: ClusterView, now_s: float) -> list[SimRequest]:
        out = []
        while self.held and self._inflight(cluster) + len(out) < self.cap:
            out.append(self.held.pop(0))
        return out

    def queued(self) -> int:
        return len(self.held)


def test_admission_gate_rejects_and_holds() -> None:
    reqs = [req(i, 0.001 * i) for i in range(8)]
    result = simulate(reqs, RoundRobin(), PROFILE, 2, gate=CapGate(cap=2, reject={3}))
    by_id = {r.id: r for r in result.records}
    assert by_id[3].rejected and by_id[3].worker is None and by_id[3].first_token_s is None
    served = [r for r in result.records if not r.rejected]
    assert all(r.finish_s is not None for r in served)
    assert all(r.dispatch_s is not None and r.dispatch_s >= r.arrival_s for r in served)
    # never more than two in flight: each dispatch happens at or after an earlier finish frees a slot
    events = sorted([(r.dispatch_s, 1) for r in served] + [(r.finish_s, -1) for r in served])  # type: ignore[misc]
    level = 0
    for _, delta in events:
        level += delta
        assert level <= 2
    assert by_id[7].dispatch_s > by_id[7].arrival_s  # type: ignore[operator]


class PrefillGate:
    """Holds a request while any prompt is still prefilling (R: pending prefill tokens)."""

    def __init__(self, release_on_first_token: bool) -> None:
        self.release_on_first_token = release_on_first_token
        self.held: list[SimRequest] = []

    def _prefilling(self, cluster: ClusterView) -> bool:
        return any(cluster.pending_prefill_tokens(w) for w in cluster.worker_ids)

    def admit(self, r: SimRequest, cluster: ClusterView, now_s: float) -> Verdict:
        if self._prefilling(cluster):
            self.held.append(r)
            return Verdict.QUEUE
        return Verdict.ADMIT

    def release(self, cluster: ClusterView, now_s: float) -> list[SimRequest]:
        out, self.held = ([], self.held) if self._prefilling(cluster) else (self.held, [])
        return out

    def queued(self) -> int:
        return len(self.held)


@pytest.mark.parametrize(
    ("on_first_token", "released_at"),
    [
        pytest.param(True, "first_token_s", id="asks for first tokens: released when the prefill ends"),
        pytest.param(False, "finish_s", id="default: released at the next finish"),
    ],
)
def test_a_gate_may_ask_to_release_at_first_tokens(on_first_token: bool, released_at: str) -> None:
    first, second = simulate(
        [req(0, 0.0, out=200), req(1, 0.001)], RoundRobin(), PROFILE, 2, gate=PrefillGate(on_first_token)
    ).records
    assert first.first_token_s is not None and first.finish_s is not None
    assert first.first_token_s < first.finish_s
    # releases happen at the engines' time, the next scrape boundary (period 0.05 s) at the latest
    assert second.dispatch_s is not None
    assert getattr(first, released_at) <= second.dispatch_s <= getattr(first, released_at) + 0.05


class LeastScrapedRunning(NoFeedback):
    """Routes on M only: fewest running + waiting at the last scrape, ties in registry order."""

    name = "least_scraped"

    def route(self, r: SimRequest, cluster: ClusterView, now_s: float) -> str:
        return min(cluster.worker_ids, key=lambda w: cluster.scraped(w).running + cluster.scraped(w).waiting)

    def on_first_token(self, r: SimRequest, worker_id: str, now_s: float) -> None:
        pass

    def on_finish(self, r: SimRequest, worker_id: str, now_s: float) -> None:
        pass


def test_scrapes_before_arrivals_only_equal_scrapes_every_period() -> None:
    reqs, _ = scale_to_load(PROFILE, build_scenario("rag", seed=4, limit=150), 3, 0.9)
    lazy = simulate(reqs, LeastScrapedRunning(), PROFILE, 3, scrape_period_s=0.05)
    eager = simulate(reqs, LeastScrapedRunning(), PROFILE, 3, scrape_period_s=0.05, every_scrape=True)
    assert eager.scrapes > lazy.scrapes
    assert [r.worker for r in lazy.records] == [r.worker for r in eager.records]
    for a, b in zip(lazy.records, eager.records, strict=True):
        assert a.first_token_s == pytest.approx(b.first_token_s, abs=1e-6)
        assert a.finish_s == pytest.approx(b.finish_s, abs=1e-6)
    assert len({r.worker for r in lazy.records}) == 3
