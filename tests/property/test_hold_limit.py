"""The affinity guards' limit (issue 9): no stickiness window or replica cap keeps a request on a worker
whose predicted wait exceeds the cost of serving it elsewhere, with the queued prefill and the queue's
lateness counted in that prediction."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from policy.config import ColdStartConfig, ReplicaConfig, RoutingConfig, StickyConfig
from policy.filters import HardOverload, ReplicaCap, StickyHold
from policy.kvgate import KvgatePolicy
from policy.scorers import effective_hit_tokens
from policy.session import SessionBinding, outcome, session_view, with_session
from policy.types import RequestView, WorkerView

IDS = [f"w{i}" for i in range(6)]
POLICY = KvgatePolicy(
    RoutingConfig(
        cold_start=ColdStartConfig(period_s=0.0),
        sticky=StickyConfig(window_s=3600.0, overload_ttft_s=3600.0, overload_ratio=100.0),
        replicas=ReplicaConfig(cap=1, hot_rate_per_s=1e6),
    )
)

workers_st = st.lists(
    st.builds(
        WorkerView,
        id=st.sampled_from(IDS),
        inflight=st.integers(0, 64),
        pending_prefill_tokens=st.integers(0, 2_000_000),
        overdue_s=st.floats(0.0, 120.0),
    ),
    min_size=2,
    max_size=6,
    unique_by=lambda w: w.id,
)


@st.composite
def request_st(draw: st.DrawFn) -> RequestView:
    n = draw(st.integers(1, 40))
    hits = draw(st.dictionaries(st.sampled_from(IDS), st.integers(0, n)))
    return RequestView(
        id="r",
        prefix_hashes=tuple(range(n)),
        block_tokens=(2048,) * n,
        prompt_tokens=2048 * n,
        prefix_hits=hits,
        sticky_worker=draw(st.sampled_from(IDS)),
        sticky_since_s=0.0,
    )


def _queued_beyond_elsewhere(
    req: RequestView, holder: WorkerView, others: list[WorkerView], candidates: list[WorkerView]
) -> bool:
    """The issue's limit: the holder's predicted TTFT above the cost of serving the request on the
    cheapest of `others`. When every candidate is busy, a recompute is capacity lost to the queue
    (`busy_weight`), on both sides: the holder's own uncached part and the other's whole prefill."""
    guard = POLICY.guard_ttft
    cost = dataclasses.replace(POLICY.cost, ttft=guard)
    busy = cost.busy_weight(req, candidates)
    hit = effective_hit_tokens(req, holder.id, guard.min_gain)
    held = guard.ttfts(req, [holder])[holder.id] + busy * guard.model.own_prefill_s(
        req.prompt_tokens - hit, hit
    )
    return bool(others) and held > min(cost.cost_s(req, w, busy) for w in others)


@settings(max_examples=400, deadline=None)
@given(req=request_st(), workers=workers_st)
def test_sticky_hold_never_keeps_a_request_where_waiting_costs_more(
    req: RequestView, workers: list[WorkerView]
) -> None:
    hold = next(f for f in POLICY.filters() if isinstance(f, StickyHold))
    kept = hold.filter(req, workers, 0.0)
    sticky = [w for w in workers if w.id == req.sticky_worker]
    others = [w for w in workers if w is not sticky[0]] if sticky else []
    if sticky and _queued_beyond_elsewhere(req, sticky[0], others, workers):
        assert len(kept) == len(workers), "the sticky worker's wait exceeds the recompute elsewhere"


@settings(max_examples=400, deadline=None)
@given(req=request_st(), workers=workers_st)
def test_replica_cap_never_keeps_a_request_where_waiting_costs_more(
    req: RequestView, workers: list[WorkerView]
) -> None:
    cap = next(f for f in POLICY.filters() if isinstance(f, ReplicaCap))
    kept = cap.filter(req, workers, 0.0)
    holders = [w for w in workers if effective_hit_tokens(req, w.id, POLICY.config.min_cache_gain) > 0]
    others = [w for w in workers if w not in holders]
    if holders and others and all(_queued_beyond_elsewhere(req, h, others, workers) for h in holders):
        assert len(kept) == len(workers), "every holder's wait exceeds the recompute on a non-holder"


@settings(max_examples=200, deadline=None)
@given(req=request_st(), workers=workers_st, late=st.floats(0.0, 600.0))
def test_lateness_only_ever_raises_the_prediction(
    req: RequestView, workers: list[WorkerView], late: float
) -> None:
    model = POLICY.ttft.model
    for w in workers:
        slower = WorkerView(**{**{f: getattr(w, f) for f in w.__slots__}, "overdue_s": w.overdue_s + late})
        assert model.ttft_s(slower, 1000, 0, late=True) >= model.ttft_s(w, 1000, 0, late=True)
        assert model.ttft_s(slower, 1000, 0, late=True) >= model.overhead_s + slower.overdue_s
        assert model.ttft_s(slower, 1000, 0) == model.ttft_s(w, 1000, 0)  # the cost model's: model only


@settings(max_examples=400, deadline=None)
@given(req=request_st(), workers=workers_st, bound=st.sampled_from(IDS), tokens=st.integers(0, 100_000))
def test_a_session_preference_never_holds_where_waiting_costs_more(
    req: RequestView, workers: list[WorkerView], bound: str, tokens: int
) -> None:
    """Explicit session affinity (policy/session.py) obeys the same limit: the session's credit never
    decides a route onto a worker whose wait, with the session's believed cache, exceeds the cost
    elsewhere; nor onto an overloaded one."""
    view = with_session(dataclasses.replace(req, sticky_worker=None), SessionBinding(bound, tokens))
    decision = POLICY.decide(view, workers, random.Random(0), now_s=0.0)
    if outcome(view, decision) != "decided":
        return
    mine = next(w for w in workers if w.id == bound)
    others = [w for w in workers if w.id != bound]
    assert not _queued_beyond_elsewhere(session_view(view), mine, others, workers)
    assert not HardOverload().overloaded(mine)
