"""policy/filters.py: each filter on hand-made candidates."""

from __future__ import annotations

import pytest

from policy.config import ReplicaConfig, StickyConfig
from policy.filters import Eligible, Filter, HardOverload, ImbalanceGuard, ReplicaCap, StickyHold
from policy.scorers import PredictedTtft, TtftModel
from policy.types import RequestView, WorkerView

TTFT = PredictedTtft(
    TtftModel(1000, decode_slowdown=0.0, overhead_s=0.0, attention_s_per_token_ctx=0.0), min_gain=0.3
)


def ids(workers: list[WorkerView]) -> list[str]:
    return [w.id for w in workers]


def req(**kw: object) -> RequestView:
    base: dict[str, object] = {
        "id": "r",
        "prefix_hashes": (1, 2),
        "block_tokens": (500, 500),
        "prompt_tokens": 1000,
    }
    base.update(kw)
    return RequestView(**base)  # type: ignore[arg-type]


POOL = [
    WorkerView(id="ok", inflight=2),
    WorkerView(id="sick", healthy=False),
    WorkerView(id="leaving", draining=True),
    WorkerView(id="full", inflight=8, max_concurrency=8),
    WorkerView(id="kv", kv_usage=1.0),
]


@pytest.mark.parametrize(
    ("flt", "workers", "expected"),
    [
        pytest.param(Eligible(), POOL, ["ok", "full", "kv"], id="eligible drops unhealthy and draining"),
        pytest.param(Eligible(), POOL[1:3], [], id="eligible may empty the set"),
        pytest.param(
            HardOverload(), POOL, ["ok", "sick", "leaving"], id="hard overload drops full slots and KV"
        ),
        pytest.param(
            HardOverload(), POOL[3:], ["full", "kv"], id="hard overload keeps all when all overloaded"
        ),
        pytest.param(
            ImbalanceGuard(abs_threshold=4, rel_threshold=1.5),
            [WorkerView(id="a", inflight=1), WorkerView(id="b", inflight=10), WorkerView(id="c", inflight=1)],
            ["a", "c"],
            id="imbalanced: least loaded only",
        ),
        pytest.param(
            ImbalanceGuard(abs_threshold=4, rel_threshold=1.5),
            [WorkerView(id="a", inflight=10), WorkerView(id="b", inflight=14)],
            ["a", "b"],
            id="rel threshold not met: all kept",
        ),
        pytest.param(
            ImbalanceGuard(abs_threshold=64, rel_threshold=1.5),
            [WorkerView(id="a", inflight=0), WorkerView(id="b", inflight=60)],
            ["a", "b"],
            id="abs threshold not met: all kept",
        ),
    ],
)
def test_filter_table(flt: Filter, workers: list[WorkerView], expected: list[str]) -> None:
    assert ids(flt.filter(req(), workers, 0.0)) == expected


PAIR = [WorkerView(id="a"), WorkerView(id="b")]


@pytest.mark.parametrize(
    ("flt", "request_view", "workers", "now_s", "expected"),
    [
        pytest.param(
            StickyHold(TTFT, StickyConfig(window_s=30)),
            req(sticky_worker="b", sticky_since_s=0.0),
            PAIR,
            10.0,
            ["b"],
            id="sticky: held in window",
        ),
        pytest.param(
            StickyHold(TTFT, StickyConfig(window_s=30)),
            req(sticky_worker="b", sticky_since_s=0.0),
            PAIR,
            31.0,
            ["a", "b"],
            id="sticky: window over",
        ),
        pytest.param(
            StickyHold(TTFT, StickyConfig(window_s=30)),
            req(sticky_worker="gone", sticky_since_s=0.0),
            PAIR,
            1.0,
            ["a", "b"],
            id="sticky: worker disappeared",
        ),
        pytest.param(
            StickyHold(TTFT, StickyConfig(window_s=30, overload_ttft_s=1.0, overload_ratio=2.0)),
            req(sticky_worker="b", sticky_since_s=0.0),
            [WorkerView(id="a"), WorkerView(id="b", pending_prefill_tokens=5000)],
            1.0,
            ["a", "b"],
            id="sticky: overloaded worker released (6 s vs 1 s)",
        ),
        pytest.param(
            StickyHold(TTFT, StickyConfig(window_s=30, overload_ttft_s=10.0, overload_ratio=2.0)),
            req(sticky_worker="b", sticky_since_s=0.0),
            [WorkerView(id="a"), WorkerView(id="b", pending_prefill_tokens=5000)],
            1.0,
            ["b"],
            id="sticky: below absolute overload threshold still held",
        ),
        pytest.param(
            StickyHold(None, StickyConfig(window_s=30), overload_inflight=4),
            req(sticky_worker="b", sticky_since_s=0.0),
            [WorkerView(id="a"), WorkerView(id="b", inflight=4)],
            1.0,
            ["a", "b"],
            id="sticky without ttft model: inflight threshold",
        ),
        pytest.param(
            StickyHold(TTFT, StickyConfig(window_s=30), skip_rate_per_s=1.0),
            req(sticky_worker="b", sticky_since_s=0.0, prefix_rate=2.0),
            PAIR,
            1.0,
            ["a", "b"],
            id="sticky: hot prefix left to replica cap",
        ),
    ],
)
def test_sticky_hold(
    flt: Filter, request_view: RequestView, workers: list[WorkerView], now_s: float, expected: list[str]
) -> None:
    assert ids(flt.filter(request_view, workers, now_s)) == expected


TRIO = [WorkerView(id="a"), WorkerView(id="b"), WorkerView(id="c")]
HELD_BY_AB = {"prefix_hits": {"a": 2, "b": 2}}


@pytest.mark.parametrize(
    ("cap", "request_view", "workers", "expected"),
    [
        pytest.param(3, req(**HELD_BY_AB), TRIO, ["a", "b", "c"], id="under cap: all"),
        pytest.param(2, req(**HELD_BY_AB), TRIO, ["a", "b"], id="at cap: holders only"),
        pytest.param(
            2,
            req(prefix_hits={"a": 2, "b": 2}, prefix_rate=5.0),
            TRIO,
            ["a", "b"],
            id="hot but not overloaded",
        ),
        pytest.param(
            2,
            req(prefix_hits={"a": 2, "b": 2}, prefix_rate=5.0),
            [
                WorkerView(id="a", pending_prefill_tokens=3000),
                WorkerView(id="b", pending_prefill_tokens=3000),
                WorkerView(id="c"),
            ],
            ["a", "b", "c"],
            id="hot and holders overloaded: new replica allowed",
        ),
        pytest.param(
            2,
            req(prefix_hits={"a": 2, "b": 2}, prefix_rate=0.1),
            [
                WorkerView(id="a", pending_prefill_tokens=3000),
                WorkerView(id="b", pending_prefill_tokens=3000),
                WorkerView(id="c"),
            ],
            ["a", "b"],
            id="overloaded but not hot: holders only",
        ),
        pytest.param(
            2,
            req(prefix_hits={"a": 2, "b": 2}, prefix_rate=5.0),
            [WorkerView(id="a", inflight=9), WorkerView(id="b", inflight=9), WorkerView(id="c", inflight=6)],
            ["a", "b", "c"],
            id="hot and holders busier than 1.25 x a non-holder + 1: new replica allowed",
        ),
        pytest.param(
            2,
            req(prefix_hits={"a": 2, "b": 2}, prefix_rate=5.0),
            [WorkerView(id="a", inflight=8), WorkerView(id="b", inflight=9), WorkerView(id="c", inflight=6)],
            ["a", "b"],
            id="hot, holders only slightly busier: holders only",
        ),
        pytest.param(
            1,
            req(prefix_hits={"a": 1, "b": 1}, block_tokens=(100, 900)),
            TRIO,
            ["a", "b", "c"],
            id="holders below min gain do not count",
        ),
    ],
)
def test_replica_cap(
    cap: int, request_view: RequestView, workers: list[WorkerView], expected: list[str]
) -> None:
    flt = ReplicaCap(
        TTFT, ReplicaConfig(cap=cap, hot_rate_per_s=1.0, overload_ttft_s=1.0, overload_load_ratio=1.25)
    )
    assert ids(flt.filter(request_view, workers, 0.0)) == expected
