"""Live workloads: block ids become text that shares exactly the leading blocks, and the rescaled
trace round-trips through the simulator's Mooncake reader."""

from __future__ import annotations

from pathlib import Path

from bench import live_workloads
from bench.emulator.tokenizer import tokenize
from bench.live_workloads import BlockText, at_load, build, cap_output, live_requests, write_mooncake_jsonl
from bench.sim.load import offered_load
from bench.sim.profiles import load_profile
from bench.sim.traces import load_trace


def test_shared_leading_blocks_give_shared_leading_tokens_and_no_more() -> None:
    reqs = build("tenants", seed=3, n=200)
    texts = BlockText(seed=1)
    by_tenant: dict[str, list] = {}
    for r in reqs:
        by_tenant.setdefault(r.tenant, []).append(r)
    a, b = next(v for v in by_tenant.values() if len(v) >= 2)[:2]
    shared = 0
    while shared < min(len(a.block_ids), len(b.block_ids)) and a.block_ids[shared] == b.block_ids[shared]:
        shared += 1
    assert shared >= 3  # the tenant's 2-6k-token system prompt: at least 3 full 512-token blocks
    ta, tb = tokenize(texts.prompt(a)), tokenize(texts.prompt(b))
    common = sum(a.block_tokens[:shared])
    assert ta[:common] == tb[:common]
    assert ta[common : common + 8] != tb[common : common + 8]
    assert len(ta) == a.input_tokens


def test_rescaled_trace_round_trips_and_keeps_the_load(tmp_path: Path) -> None:
    profile = load_profile("h100-llama3.1-8b")
    reqs = cap_output(build("mooncake", seed=1, n=50), 128)
    assert max(r.output_tokens for r in reqs) <= 128
    scaled = at_load(reqs, profile, workers=4, load=2.0)
    assert abs(offered_load(profile, scaled, 4) - 2.0) < 1e-6
    path = tmp_path / "t.jsonl"
    write_mooncake_jsonl(scaled, path)
    back = load_trace(path)
    assert [r.block_ids for r in back] == [r.block_ids for r in scaled]
    assert abs(back[-1].arrival_s - scaled[-1].arrival_s) < 1e-3
    live = live_requests(scaled, "m", time_scale=2.0)
    assert abs(live[-1].send_at_s - 2.0 * scaled[-1].arrival_s) < 1e-9
    assert live[0].body["max_tokens"] == scaled[0].output_tokens


def test_offered_rate_is_requests_over_the_arrival_span_and_doubles_with_the_load() -> None:
    profile = load_profile("h100-llama3.1-8b")
    reqs = cap_output(build("tenants", seed=1, n=300), 256)
    at_1, at_2 = at_load(reqs, profile, 4, 1.0), at_load(reqs, profile, 4, 2.0)
    span = at_2[-1].arrival_s - at_2[0].arrival_s
    assert live_workloads.offered_rps(at_2) == 300 / span
    assert abs(live_workloads.offered_rps(at_2) / live_workloads.offered_rps(at_1) - 2.0) < 1e-9
    assert live_workloads.offered_rps(at_2[:1]) == 0.0
