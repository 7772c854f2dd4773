"""bench/churn_live.py's workload: the live churn scenario's bypass traffic, tenant prompts and load."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from bench import toy_model
from bench.churn_live import Shape, build, plan, sim_requests
from bench.demo import PROFILE, WORKERS
from bench.emulator.tokenizer import full_block_keys
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


def test_the_simulator_replays_the_live_plan_with_its_bypass_restart_and_engine_blocks(
    tokenizer: Path,
) -> None:
    raw = build(2, 80, 6, Shape((40, 90), (5, 20), (10, 30)))
    p = plan(raw, tokenizer, 1500, 1.6, 4.0)
    reqs = sim_requests(p)
    assert [r.bypass for r in reqs] == [w is not None for _, w in p.requests]
    # the simulator sends a bypass request to crc32(tenant) % workers: the worker the live client uses
    assert all(
        zlib.crc32(r.tenant.encode()) % WORKERS == w
        for r, (_, w) in zip(reqs, p.requests, strict=True)
        if r.bypass
    )
    assert [i for i, r in enumerate(reqs) if r.restart_before] == [len(reqs) // 2]
    assert reqs[len(reqs) // 2].restart_before == ("w0",)
    assert [r.arrival_s for r in reqs] == [q.send_at_s / 4.0 for q, _ in p.requests]  # model seconds
    assert [r.input_tokens for r in reqs] == p.input_tokens
    assert [r.output_tokens for r in reqs] == [q.body["max_tokens"] for q, _ in p.requests]
    for r, toks in zip(reqs, p.tokens, strict=True):
        full = len(toks) // 16
        assert list(r.block_ids[:full]) == full_block_keys(toks, 16)  # the emulator's keys of the same ids
        assert sum(r.block_tokens) == len(toks)
    # two requests of one tenant share the blocks of its system prompt, not those of their own questions
    by_tenant: dict[str, list[SimRequest]] = {}
    for r in reqs:
        by_tenant.setdefault(r.tenant, []).append(r)
    a, b = next(rs for rs in by_tenant.values() if len(rs) > 1)[:2]
    assert a.block_ids[0] == b.block_ids[0] and a.block_ids[-1] != b.block_ids[-1]
