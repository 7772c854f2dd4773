"""bench/churn_live.py's workload: the live churn scenario's bypass traffic and tenant prompts."""

from __future__ import annotations

from bench.churn_live import build
from bench.demo import WORKERS


def test_a_fifth_bypasses_the_gateway_and_each_tenant_bypasses_to_one_worker() -> None:
    plan = build(1, 400, 10.0, 24, 300)
    bypass = [(req.body["messages"][0]["content"], w) for req, w in plan if w is not None]  # type: ignore[index]
    assert 0.12 < len(bypass) / len(plan) < 0.28
    by_tenant: dict[object, set[int]] = {}
    for system, w in bypass:
        by_tenant.setdefault(system, set()).add(w)
    assert all(len(ws) == 1 for ws in by_tenant.values())
    assert all(0 <= w < WORKERS for _, w in bypass)
    assert [r.send_at_s for r, _ in plan] == sorted(r.send_at_s for r, _ in plan)
    assert build(1, 400, 10.0, 24, 300) == plan  # deterministic per seed
