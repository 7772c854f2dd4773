"""The simulator's index models for kvgate (bench/sim/policy_router.py) and the churn scenario."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim.cli import main
from bench.sim.cluster import simulate
from bench.sim.policy_router import PolicyRouter
from bench.sim.profiles import load_profile
from bench.sim.scenarios import build_scenario
from policy.config import RoutingConfig


def run(index: str, n: int = 400) -> dict[str, float]:
    reqs = build_scenario("churn", 1, n)
    router = PolicyRouter("kvgate", RoutingConfig(policy="kvgate"), 1, index=index)
    result = simulate(reqs, router, load_profile("h100-llama3.1-8b"), 4)
    routed = [r for r, q in zip(result.records, reqs, strict=True) if not q.bypass]
    return {
        "hit": sum(r.cached_tokens for r in result.records) / sum(r.input_tokens for r in result.records),
        "routed": len(routed),
        "bypass_on_one_worker": len({r.worker for r, q in zip(result.records, reqs, strict=True)
                                     if q.bypass and q.tenant == reqs[0].tenant}),
    }  # fmt: skip


def test_churn_has_bypass_traffic_and_one_restart() -> None:
    reqs = build_scenario("churn", 1, 400)
    assert 0.1 < sum(r.bypass for r in reqs) / len(reqs) < 0.3
    assert [r.restart_before for r in reqs if r.restart_before] == [("w0",)]


def test_exact_follows_the_engines_and_oracle_is_the_truth() -> None:
    exact, oracle, approx = run("exact"), run("oracle"), run("approx")
    assert exact["routed"] == oracle["routed"] == approx["routed"]
    assert exact["bypass_on_one_worker"] <= 1  # a bypassing tenant's client talks to one worker
    assert exact["hit"] >= 0.95 * oracle["hit"]


def test_unknown_index_model_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown index model"):
        PolicyRouter("kvgate", RoutingConfig(policy="kvgate"), 1, index="psychic")


def test_cli_index_adds_index_to_each_run(tmp_path: Path) -> None:
    args = ["--scenario", "churn", "--policies", "kvgate", "--index", "exact,approx,oracle",
            "--limit", "200", "--workers", "2", "--out", str(tmp_path), "--no-plots",
            "--jobs", "1"]  # fmt: skip
    assert main(args) == 0
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["policy"], r["index"]) for r in runs] == [
        ("kvgate", "exact"), ("kvgate", "approx"), ("kvgate", "oracle"),
    ]  # fmt: skip
    assert main([*args[:4], "--index", "exact", "--policies", "round_robin"]) == 2


def test_churn_working_set_exceeds_the_pooled_cache_and_runs_past_cold_capacity() -> None:
    from bench.sim.runner import prepare_workload
    from bench.sim.scenarios import default_load

    profile = load_profile("h100-llama3.1-8b")
    workload = prepare_workload("churn", build_scenario("churn", 1, None), profile, 8, default_load("churn"))
    assert workload.cache_pressure > 8 * 1.2  # > 1.2x the 8 workers' pooled KV
    assert workload.pooled_lru_hit_rate < workload.infinite_hit_rate - 0.08
    assert default_load("churn") > 1.0 and default_load("multi_tenant") == default_load(None) == 0.8
