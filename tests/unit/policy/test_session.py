"""policy/session.py: explicit session affinity as a soft preference inside kvgate's cost model."""

from __future__ import annotations

import dataclasses
import random

import pytest

from policy.config import SessionConfig
from policy.kvgate import KvgatePolicy
from policy.session import (
    CREDIT,
    SessionBinding,
    SessionTable,
    outcome,
    session_view,
    with_session,
)
from policy.types import RequestView, WorkerView
from tests.unit.policy.test_kvgate import CONFIG  # 1000 tokens/s, no overhead: costs by hand

POLICY = KvgatePolicy(CONFIG)


def req(session: SessionBinding | None = None, hits: dict[str, int] | None = None) -> RequestView:
    view = RequestView(
        id="r",
        prefix_hashes=(1, 2, 3, 4),
        block_tokens=(500, 500, 500, 500),
        prompt_tokens=2000,
        prefix_hits=hits or {},
    )
    return with_session(view, session)


def decide(view: RequestView, workers: list[WorkerView], policy: KvgatePolicy = POLICY) -> str | None:
    decision = policy.decide(view, workers, random.Random(1), now_s=100.0)
    return decision.worker


# "b" carries 100 tokens of queued prefill: without the session, "a" is cheaper by 0.1 s
WORKERS = [WorkerView("a"), WorkerView("b", pending_prefill_tokens=100)]


def test_the_session_worker_wins_on_the_cache_the_session_left_there() -> None:
    view = req(SessionBinding("b", 1500))
    decision = POLICY.decide(view, WORKERS, random.Random(1), now_s=100.0)
    assert decision.worker == "b"
    assert outcome(view, decision) == "decided"
    assert decision.reason.startswith("session on b")
    # credited its believed 1500 cached tokens: 1.5 s of prefill
    assert decision.scores["b"][CREDIT] == pytest.approx(1.5)
    assert decide(req(), WORKERS) == "a"  # no session: the cost model alone


def test_no_credit_where_the_index_already_knows_as_much() -> None:
    view = req(SessionBinding("b", 1000), hits={"b": 2})
    decision = POLICY.decide(view, WORKERS, random.Random(1), now_s=100.0)
    assert decision.worker == "b"
    assert CREDIT not in decision.scores["b"]
    assert outcome(view, decision) == "followed"


def test_an_overloaded_session_worker_gets_no_preference() -> None:
    full = [WorkerView("a"), WorkerView("b", inflight=4, max_concurrency=4)]
    view = req(SessionBinding("b", 2000))
    decision = POLICY.decide(view, full, random.Random(1), now_s=100.0)
    assert decision.worker == "a"
    assert outcome(view, decision) == "moved"


def test_the_hold_limit_moves_a_session_off_a_late_worker() -> None:
    # b's queue runs 3 s late (policy/ledger.py): its wait exceeds serving the request on a from scratch
    # (2 s), so the session may not hold it there, whatever cache it left on b
    late = [WorkerView("a"), WorkerView("b", overdue_s=3.0)]
    view = req(SessionBinding("b", 2000))
    decision = POLICY.decide(view, late, random.Random(1), now_s=100.0)
    assert decision.worker == "a"
    assert CREDIT not in decision.scores["b"]
    # a little late is within the limit: the preference holds
    slightly = [WorkerView("a"), WorkerView("b", overdue_s=0.5)]
    assert decide(view, slightly) == "b"


def test_a_session_bound_to_a_worker_that_left_is_placed_by_the_cost_model() -> None:
    view = req(SessionBinding("gone", 2000))
    decision = POLICY.decide(view, WORKERS, random.Random(1), now_s=100.0)
    assert decision.worker == "a" and outcome(view, decision) == "moved"


def test_weight_zero_turns_it_off() -> None:
    off = KvgatePolicy(dataclasses.replace(CONFIG, session=SessionConfig(weight=0.0)))
    assert decide(req(SessionBinding("b", 1500)), WORKERS, off) == "a"


def test_the_believed_cache_is_whole_leading_blocks_of_this_prompt() -> None:
    view = req(SessionBinding("b", 1200))
    assert session_view(view).prefix_hits == {"b": 2}  # 1200 tokens cover two 500-token blocks
    assert session_view(req(SessionBinding("b", 9000))).prefix_hits == {"b": 4}  # capped by the prompt
    assert session_view(req()).prefix_hits == {}


def test_session_table_ttl_active_requests_and_close() -> None:
    table = SessionTable(ttl_s=10.0)
    table.started("s", "w1", 100, now_s=0.0)
    assert table.lookup("s", 50.0) == SessionBinding("w1", 100)  # in flight: never expires
    table.finished("s", now_s=50.0)
    assert table.lookup("s", 59.0) == SessionBinding("w1", 100)  # idle less than the TTL
    assert table.lookup("s", 61.0) is None  # idle past it: gone
    table.started("s", "w2", 300, now_s=70.0)
    table.started("s", "w3", 400, now_s=71.0)  # rebinds to the latest route
    table.finished("s", now_s=72.0)
    assert table.lookup("s", 200.0) == SessionBinding("w3", 400)  # one request still in flight
    table.finished("s", now_s=72.0, close=True)  # the client closed the session
    assert table.lookup("s", 72.0) is None and len(table) == 0
