"""bench/sim/policy_router.py on the real simulator: the adapter drives policy/ through RoutingState."""

from __future__ import annotations

import dataclasses

import pytest

from bench.sim.cluster import simulate
from bench.sim.load import scale_to_load
from bench.sim.metrics import compute_metrics
from bench.sim.policy_router import PolicyRouter, make_article_router, make_kvgate_router
from bench.sim.profiles import load_profile
from bench.sim.registry import make_router
from bench.sim.scenarios import build_scenario
from bench.sim.types import SimRequest

PROFILE = load_profile("h100-llama3.1-8b")


@pytest.fixture(scope="module")
def requests() -> list:
    reqs, _ = scale_to_load(PROFILE, build_scenario("multi_tenant", seed=1, limit=400), 4, 0.8)
    return reqs


def run(router: object, requests: list) -> tuple[list[str | None], dict[str, object]]:
    result = simulate(requests, router, PROFILE, 4)  # type: ignore[arg-type]
    return [r.worker for r in result.records], compute_metrics(result, requests, PROFILE)


@pytest.mark.parametrize("factory", [make_kvgate_router, make_article_router], ids=["kvgate", "article"])
def test_same_seed_same_run_and_cache_beats_round_robin(factory: object, requests: list) -> None:
    workers_a, metrics = run(factory(7), requests)  # type: ignore[operator]
    workers_b, _ = run(factory(7), requests)  # type: ignore[operator]
    assert workers_a == workers_b
    assert len(set(workers_a)) == 4, "every worker gets traffic"
    _, rr = run(make_router("round_robin", 7), requests)
    assert metrics["hit_rate"] > rr["hit_rate"] + 0.1  # type: ignore[operator]


def test_counters_return_to_zero_and_index_is_sized_from_capacity(requests: list) -> None:
    router = make_kvgate_router(1)
    assert isinstance(router, PolicyRouter)
    run(router, requests)
    assert router.decisions == len(requests)
    ledger = router.ledger
    for w in ("w0", "w1", "w2", "w3"):
        assert (ledger.inflight(w), ledger.pending_prefill_tokens(w), ledger.pending_requests(w)) == (0, 0, 0)
        assert ledger.overdue_s(w, 1e9) == 0.0
    block = max(max(r.block_tokens) for r in requests)
    assert router.state.index.capacity("w0") == PROFILE.capacity_tokens // block
    assert all(router.state.index.size(w) <= router.state.index.capacity(w) for w in ("w0", "w1", "w2", "w3"))


def test_registry_names_resolve_to_the_adapter() -> None:
    assert make_router("kvgate", 1).name == "kvgate"
    assert make_router("article", 1).name == "article"


def test_kvgate_session_keeps_bindings_for_the_sessions_and_closes_them() -> None:
    # two conversations of growing prompts; their sessions bind, and each closes with its last call
    reqs = []
    for conv in range(2):
        for turn in range(6):
            blocks = tuple(1000 * conv + b for b in range(turn + 2))
            at, tokens = 2.0 * turn + conv * 0.5, (512,) * len(blocks)
            last = turn == 5
            reqs.append(
                SimRequest(0, at, sum(tokens), 16, blocks, tokens, session=f"c{conv}", session_close=last)
            )
    reqs.sort(key=lambda r: r.arrival_s)
    reqs = [dataclasses.replace(r, id=i) for i, r in enumerate(reqs)]
    router = make_router("kvgate_session", 1)
    assert isinstance(router, PolicyRouter) and router.sessions is not None
    workers, _ = run(router, reqs)
    assert router.session_outcomes["new"] == 2  # each session's first call found no binding
    assert sum(router.session_outcomes.values()) == len(reqs)
    assert len(router.sessions) == 0  # both closed by their last call
    plain, _ = run(make_router("kvgate", 1), reqs)
    assert plain == workers  # the index knew as much: the credit never changed a route here


def test_feedback_index_unlearns_a_restart_from_the_next_report() -> None:
    """`kvgate@feedback`: the first request after w0's restart expects a hit, w0 reports none, and the
    older prefix w0 was believed to hold leaves the index; plain `approx` keeps believing it."""

    def request(i: int, at: float, prefix: int, restart: bool = False) -> SimRequest:
        ids = (prefix, prefix + 1, prefix + 2, prefix + 3, 1000 + i)
        return SimRequest(
            i, at, 2100, 8, ids, (512, 512, 512, 512, 52), restart_before=("w0",) if restart else ()
        )

    reqs = [request(0, 0.0, 10), request(1, 1.0, 20), request(2, 2.0, 20, restart=True), request(3, 3.0, 30)]
    held = {}
    for index in ("approx", "feedback"):
        router = make_router(f"kvgate@{index}", 1)
        assert isinstance(router, PolicyRouter)
        result = simulate(reqs, router, PROFILE, 1)
        assert result.records[2].cached_tokens == 0  # the restart emptied w0's cache
        held[index] = router.state.index.match((10, 11, 12, 13)).get("w0", 0)
    assert held == {"approx": 4, "feedback": 0}
