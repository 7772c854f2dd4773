"""policy/article.py: the article's formula, its sign quirk read as a switching penalty, §2.4 rules."""

from __future__ import annotations

import random

import pytest

from policy.article import article_policy
from policy.config import RoutingConfig
from policy.types import RequestView, WorkerView

POLICY = article_policy(RoutingConfig(policy="article"))


def req(hits: dict[str, int], sticky: str | None = None, since: float | None = None) -> RequestView:
    return RequestView(
        id="r",
        prefix_hashes=(1, 2),
        block_tokens=(500, 500),
        prompt_tokens=1000,
        prefix_hits=hits,
        sticky_worker=sticky,
        sticky_since_s=since,
    )


def cost(load: float, hit: float, stable: float) -> float:
    return 1.2 * load + 0.7 * (1 - hit) + 0.3 * stable


@pytest.mark.parametrize(
    ("request_view", "workers", "now_s", "winner"),
    [
        pytest.param(
            req({"a": 2}),
            [WorkerView(id="a", inflight=8), WorkerView(id="b", inflight=0)],
            0.0,
            "a",
            # a: 1.2*0.25 + 0 + 0.3 = 0.6; b: 0 + 0.7 + 0.3 = 1.0
            id="cache beats a small load gap",
        ),
        pytest.param(
            req({"a": 2}),
            [WorkerView(id="a", inflight=24), WorkerView(id="b", inflight=0)],
            0.0,
            "b",
            # a: 1.2*0.75 + 0.3 = 1.2; b: 1.0
            id="load beats cache when the gap is large",
        ),
        pytest.param(
            req({"a": 1}),
            [WorkerView(id="a", inflight=2), WorkerView(id="b", inflight=0)],
            0.0,
            "a",
            # 50 % hit ≥ 30 % min gain counts
            id="half hit counts",
        ),
        pytest.param(
            RequestView(
                id="r",
                prefix_hashes=(1, 2),
                block_tokens=(200, 800),
                prompt_tokens=1000,
                prefix_hits={"a": 1},
            ),
            [WorkerView(id="a", inflight=2), WorkerView(id="b", inflight=0)],
            0.0,
            "b",
            id="20 % hit is below the minimum gain: load decides",
        ),
        pytest.param(
            req({}, sticky="a", since=0.0),
            [WorkerView(id="a", inflight=20), WorkerView(id="b")],
            10.0,
            "a",
            id="within the stickiness window the prefix stays",
        ),
        pytest.param(
            req({}, sticky="a", since=0.0),
            [WorkerView(id="a", inflight=32), WorkerView(id="b")],
            10.0,
            "b",
            id="sticky worker at the hard threshold is released",
        ),
        pytest.param(
            req({}, sticky="a", since=0.0),
            [WorkerView(id="a", inflight=4), WorkerView(id="b")],
            40.0,
            "b",
            id="after the window the formula decides",
        ),
        pytest.param(
            req({"a": 2}),
            [WorkerView(id="a", draining=True), WorkerView(id="b", inflight=30)],
            0.0,
            "b",
            id="never a draining worker",
        ),
    ],
)
def test_article_decisions(
    request_view: RequestView, workers: list[WorkerView], now_s: float, winner: str
) -> None:
    assert POLICY.decide(request_view, workers, random.Random(0), now_s).worker == winner


def test_article_total_is_the_article_cost() -> None:
    workers = [WorkerView(id="a", inflight=8), WorkerView(id="b", inflight=0)]
    d = POLICY.decide(req({"a": 2}), workers, random.Random(0), 0.0)
    total_weight = 1.2 + 0.7 + 0.3
    assert total_weight - d.scores["a"]["total"] == pytest.approx(cost(0.25, 1.0, 1.0))
    assert total_weight - d.scores["b"]["total"] == pytest.approx(cost(0.0, 0.0, 1.0))
