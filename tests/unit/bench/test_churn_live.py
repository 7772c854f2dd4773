"""bench/churn_live.py's workload: the live churn scenario's bypass traffic, tenant prompts and load."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import toy_model
from bench.churn_live import Shape, build, plan
from bench.demo import PROFILE, WORKERS
from bench.sim.load import offered_load
from bench.sim.profiles import load_profile
from bench.sim.types import SimRequest


def test_a_fifth_bypasses_the_gateway_and_each_tenant_bypasses_to_one_worker() -> None:
    requests = build(1, 400, 24, Shape((300, 300)))
    bypass = [(req.body["messages"][0]["content"], w) for req, w in requests if w is not None]  # type: ignore[index]
    assert 0.12 < len(bypass) / len(requests) < 0.28
    by_tenant: dict[object, set[int]] = {}
    for system, w in bypass:
        by_tenant.setdefault(system, set()).add(w)
    assert all(len(ws) == 1 for ws in by_tenant.values())
    assert all(0 <= w < WORKERS for _, w in bypass)
    assert [r.send_at_s for r, _ in requests] == sorted(r.send_at_s for r, _ in requests)
    assert build(1, 400, 24, Shape((300, 300))) == requests  # deterministic per seed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return toy_model.build(tmp_path_factory.mktemp("model"))


def test_the_plan_offers_the_asked_load_of_the_engine_models_cold_capacity(tokenizer: Path) -> None:
    raw = build(1, 60, 8, Shape((300, 300)))
    p = plan(raw, tokenizer, 1500, 1.6, 4.0)
    # in model seconds (wall / time scale), by the simulator's own rule, at the workers' token counts
    timed = zip(p.requests, p.input_tokens, strict=True)
    sim = [SimRequest(i, r.send_at_s / 4.0, n, 16, (), ()) for i, ((r, _), n) in enumerate(timed)]
    assert offered_load(load_profile(PROFILE), sim, WORKERS) == pytest.approx(1.6)
    assert p.rate_model_rps == pytest.approx(1.6 * p.cold_capacity_rps)
    slower = plan(raw, tokenizer, 1500, 0.8, 4.0)
    assert slower.cold_capacity_rps == pytest.approx(p.cold_capacity_rps)
    assert slower.requests[-1][0].send_at_s == pytest.approx(2 * p.requests[-1][0].send_at_s)
    assert [w for _, w in p.requests] == [w for _, w in raw]
    assert min(p.input_tokens) > 300 and p.pressure > 0
