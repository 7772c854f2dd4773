"""Invariants of policy/ under hypothesis: score ranges, zero weights, eligibility, determinism,
bounded index memory, canonical text independent of JSON key order."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from policy.article import article_policy
from policy.config import RoutingConfig
from policy.filters import Eligible
from policy.index import PrefixIndex
from policy.kvgate import KvgatePolicy
from policy.pickers import MaxScore
from policy.prefix import text_block_hashes
from policy.profile import Profile
from policy.request import canonical_text
from policy.scorers import (
    ColdStart,
    KvFree,
    Load,
    PredictedTtft,
    PrefixMatch,
    QueueDepth,
    Stickiness,
    TtftModel,
)
from policy.types import RequestView, WorkerView

workers_st = st.lists(
    st.builds(
        WorkerView,
        id=st.sampled_from([f"w{i}" for i in range(8)]),
        inflight=st.integers(0, 200),
        running=st.integers(0, 200),
        waiting=st.integers(0, 200),
        kv_usage=st.floats(0.0, 1.0),
        pending_prefill_tokens=st.integers(0, 500_000),
        max_concurrency=st.integers(0, 64),
        joined_s=st.floats(0.0, 1000.0),
        healthy=st.booleans(),
        draining=st.booleans(),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda w: w.id,
)


@st.composite
def requests_st(draw: st.DrawFn) -> RequestView:
    n = draw(st.integers(0, 12))
    tokens = tuple(draw(st.lists(st.integers(1, 512), min_size=n, max_size=n)))
    hits = draw(st.dictionaries(st.sampled_from([f"w{i}" for i in range(8)]), st.integers(0, n)))
    sticky = draw(st.none() | st.sampled_from([f"w{i}" for i in range(8)]))
    return RequestView(
        id="r",
        prefix_hashes=tuple(range(n)),
        block_tokens=tokens,
        prompt_tokens=sum(tokens) + draw(st.integers(0, 100)),
        prefix_hits=hits,
        sticky_worker=sticky,
        sticky_since_s=draw(st.floats(0.0, 1000.0)) if sticky else None,
        prefix_rate=draw(st.floats(0.0, 100.0)),
    )


SCORERS = [
    PrefixMatch(min_gain=0.3),
    Load(saturate_at=32),
    QueueDepth(saturate_at=16),
    KvFree(),
    Stickiness(window_s=30.0),
    ColdStart(period_s=60.0, discount=0.3),
    PredictedTtft(TtftModel()),
]


@settings(max_examples=200, deadline=None)
@given(req=requests_st(), workers=workers_st, now_s=st.floats(0.0, 2000.0))
def test_scores_lie_in_unit_interval(req: RequestView, workers: list[WorkerView], now_s: float) -> None:
    for scorer in SCORERS:
        scores = scorer.score(req, workers, now_s)
        assert set(scores) == {w.id for w in workers}
        assert all(0.0 <= v <= 1.0 for v in scores.values()), scorer.name


POLICIES = [KvgatePolicy(RoutingConfig()), article_policy(RoutingConfig(policy="article"))]


@settings(max_examples=200, deadline=None)
@given(req=requests_st(), workers=workers_st, now_s=st.floats(0.0, 2000.0), seed=st.integers(0, 2**32))
def test_never_an_ineligible_worker_and_same_seed_same_decision(
    req: RequestView, workers: list[WorkerView], now_s: float, seed: int
) -> None:
    eligible = {w.id for w in workers if w.healthy and not w.draining}
    for policy in POLICIES:
        d = policy.decide(req, workers, random.Random(seed), now_s)
        if eligible:
            assert d.worker in eligible
            assert set(d.scores) <= eligible
        else:
            assert d.worker is None
        again = policy.decide(req, list(reversed(workers)), random.Random(seed), now_s)
        assert again.worker == d.worker


@settings(max_examples=100, deadline=None)
@given(req=requests_st(), workers=workers_st, seed=st.integers(0, 2**32))
def test_a_zero_weight_scorer_changes_nothing(req: RequestView, workers: list[WorkerView], seed: int) -> None:
    base = [(Load(saturate_at=32), 1.2), (PrefixMatch(min_gain=0.3), 0.7)]
    plain = Profile("p", [Eligible()], base, MaxScore())
    extra = Profile("p", [Eligible()], [*base, (QueueDepth(saturate_at=4), 0.0)], MaxScore())
    a = plain.decide(req, workers, random.Random(seed), 0.0)
    b = extra.decide(req, workers, random.Random(seed), 0.0)
    assert a.worker == b.worker
    assert all(a.scores[w]["total"] == b.scores[w]["total"] for w in a.scores)


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from("abc"), st.lists(st.integers(0, 60), min_size=0, max_size=20), st.booleans()
        ),
        max_size=60,
    ),
    capacity=st.integers(1, 16),
)
def test_index_memory_is_bounded_and_match_is_consistent(
    ops: list[tuple[str, list[int], bool]], capacity: int
) -> None:
    idx = PrefixIndex(capacity)
    for t, (worker, hashes, remove) in enumerate(ops):
        if remove:
            idx.remove(worker, hashes)
        else:
            idx.insert(worker, hashes, float(t))
        assert all(idx.size(w) <= capacity for w in "abc")
        assert idx.total_entries() <= 3 * capacity
    for _, hashes, _ in ops:
        for worker, n in idx.match(hashes).items():
            assert 1 <= n <= len(hashes)
            assert all(worker in idx.holders(h) for h in hashes[:n])


json_scalar = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5)
json_obj = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
message_st = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=40)},
    optional={"name": st.text(min_size=1, max_size=5)},
)


@settings(max_examples=100, deadline=None)
@given(
    messages=st.lists(message_st, min_size=1, max_size=5),
    tools=st.none() | st.lists(st.dictionaries(st.text(max_size=4), json_obj, max_size=3), max_size=2),
    seed=st.integers(0, 1000),
)
def test_canonical_text_ignores_json_key_order(
    messages: list[dict[str, str]], tools: list[dict[str, object]] | None, seed: int
) -> None:
    body: dict[str, object] = {"model": "m", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    rng = random.Random(seed)

    def shuffle(value: object) -> object:
        if isinstance(value, dict):
            items = list(value.items())
            rng.shuffle(items)
            return {k: shuffle(v) for k, v in items}
        if isinstance(value, list):
            return [shuffle(v) for v in value]
        return value

    shuffled = json.loads(json.dumps(shuffle(body), indent=rng.choice([None, 1, 4])))
    assert canonical_text(shuffled) == canonical_text(body)
    longer = {**body, "messages": [*messages, {"role": "user", "content": "more"}]}
    assert canonical_text(longer).startswith(canonical_text(body))
    a, _ = text_block_hashes(canonical_text(body), model="m", chunk_chars=16)
    b, _ = text_block_hashes(canonical_text(longer), model="m", chunk_chars=16)
    full = len(canonical_text(body)) // 16
    assert a[:full] == b[:full]
