"""`python -m bench.sim.xcheck_dynamo`: the kvgate side, the JSON interface, the goal arithmetic, and
(when ai-dynamo is installed, an optional extra) the real Dynamo replay."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench.sim.profiles import EngineProfile, load_profile
from bench.sim.xcheck_dynamo import (
    ALONE_PROMPTS,
    INSTALL_HINT,
    MATCHED_PROFILE,
    METRIC_KEYS,
    comparison,
    cross_check,
    engine_check,
    main,
    mocker_engine_args,
    replay_metrics,
    run_kvgate,
)

PROFILE = load_profile("h100-llama3.1-8b")
HAVE_DYNAMO = importlib.util.find_spec("dynamo") is not None


def small_trace(path: Path) -> Path:
    """Two families of requests sharing 512-token prefixes, 40 ms apart."""
    lines = []
    for i in range(40):
        family = i % 2
        prefix = [family * 1000 + b for b in range(4)]
        lines.append(
            json.dumps(
                {
                    "timestamp": 40 * i,
                    "input_length": 5 * 512 - 100,
                    "output_length": 20,
                    "hash_ids": [*prefix, 10_000 + i],
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_mocker_gets_the_profiles_block_size_and_capacity() -> None:
    engine = mocker_engine_args(PROFILE)["engine"]
    assert engine["block_size"] * engine["num_gpu_blocks"] == PROFILE.capacity_tokens
    assert (engine["max_num_seqs"], engine["max_num_batched_tokens"]) == (
        PROFILE.max_num_seqs,
        PROFILE.max_num_batched_tokens,
    )


def test_replay_summary_becomes_fractions_and_seconds() -> None:
    summary = {"prefix_cache_reused_ratio": 0.25, "median_ttft_ms": 40.0, "p99_ttft_ms": 1500.0, "x": 1}
    assert replay_metrics(summary) == {"hit_rate": 0.25, "ttft_p50": 0.04, "ttft_p99": 1.5}


def test_the_kvgate_side_replays_the_trace_and_reports_hits(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    kv = run_kvgate(trace, "dynamo", PROFILE, 2, 1)
    rr = run_kvgate(trace, "round_robin", PROFILE, 2, 1)
    assert set(kv) == set(METRIC_KEYS) == set(rr)
    # each family's 4 shared blocks are cached after its first request: 2 of 2 workers x 2 families
    assert kv["hit_rate"] > 0.5 and rr["hit_rate"] > 0.5
    assert 0 < kv["ttft_p50"] <= kv["ttft_p99"]


def test_the_json_document_has_exactly_the_issues_interface(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    calls: list[tuple[str, int]] = []

    def stand_in(path: Path, mode: str, profile: EngineProfile, workers: int) -> dict[str, float]:
        calls.append((mode, workers))  # in place of Dynamo's replay, which is an optional extra
        return {"hit_rate": 0.5, "ttft_p50": 0.1, "ttft_p99": 1.0}

    doc = cross_check(trace, PROFILE, workers=2, dynamo=stand_in)
    assert calls == [("kv_router", 2), ("round_robin", 2)]
    assert set(doc) == {"dynamo_replay", "kvgate_sim"}
    assert set(doc["dynamo_replay"]) == {"kv_router", "round_robin"}
    assert set(doc["kvgate_sim"]) == {"dynamo", "round_robin"}
    for side in doc.values():
        for metrics in side.values():
            assert set(metrics) == {"hit_rate", "ttft_p50", "ttft_p99"}
    json.dumps(doc)  # plain data


def test_goal_checks_points_and_ratios() -> None:
    doc = {
        "dynamo_replay": {
            "kv_router": {"hit_rate": 0.30, "ttft_p50": 0.04, "ttft_p99": 1.0},
            "round_robin": {"hit_rate": 0.06, "ttft_p50": 0.20, "ttft_p99": 2.0},
        },
        "kvgate_sim": {
            "dynamo": {"hit_rate": 0.26, "ttft_p50": 0.05, "ttft_p99": 3.0},
            "round_robin": {"hit_rate": 0.06, "ttft_p50": 0.30, "ttft_p99": 19.0},
        },
    }
    c = comparison(doc)
    assert c["kv_hit_gap_points"] == pytest.approx(-4.0) and not c["kv_hit_ok"]
    assert c["rr_hit_gap_points"] == pytest.approx(0.0) and c["rr_hit_ok"]
    assert (c["dynamo_rr_over_kv_p50"], c["kvgate_rr_over_kv_p50"]) == pytest.approx((5.0, 6.0))
    assert c["ratio_ok"]  # 6 is within 30 % of 5


@pytest.mark.skipif(HAVE_DYNAMO, reason="ai-dynamo is installed: the missing-package path cannot run")
def test_without_dynamo_it_says_how_to_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    assert main([str(trace), "--json", str(tmp_path / "x.json"), "--workers", "2"]) == 2
    assert INSTALL_HINT in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_bad_trace_fails_before_any_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main([str(bad), "--json", str(tmp_path / "x.json")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


@pytest.mark.skipif(
    not HAVE_DYNAMO, reason="ai-dynamo not installed (optional extra .[xcheck], docs/SIMULATOR.md)"
)
def test_against_the_real_dynamo_replay(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    out = tmp_path / "x.json"
    assert main([str(trace), "--json", str(out), "--workers", "2"]) == 0
    doc = json.loads(out.read_text())
    assert doc["dynamo_replay"]["kv_router"]["hit_rate"] > 0.5


def test_by_default_our_side_runs_on_the_mocker_profile() -> None:
    matched = load_profile(MATCHED_PROFILE)
    assert matched.t_prefill_ms > 0  # the mocker's per-prefill-step constant
    engine = mocker_engine_args(matched)["engine"]
    assert (
        engine["block_size"] * engine["num_gpu_blocks"] == matched.capacity_tokens == PROFILE.capacity_tokens
    )


def test_engine_check_runs_both_engines_alone_and_overloaded(tmp_path: Path) -> None:
    seen: list[tuple[str, str, int]] = []

    def stand_in(trace: Path, mode: str, profile: EngineProfile, workers: int) -> dict[str, float]:
        seen.append((trace.stem, mode, workers))
        return {"median_ttft_ms": 169.1, "p99_ttft_ms": 169.1, "median_e2e_latency_ms": 1520.5}

    doc = engine_check(load_profile(MATCHED_PROFILE), tmp_path, dynamo=stand_in)
    assert set(doc) == {*(f"alone-{n}" for n in ALONE_PROMPTS), "overload"}
    assert all(mode == "round_robin" and workers == 1 for _, mode, workers in seen)
    assert doc["alone-8192"]["dynamo"] == {"ttft_p50": 0.1691, "ttft_p99": 0.1691, "e2e_p50": 1.5205}
    # the mocker's 8,192-token prefill is 169.1 ms (its polynomial); the derived profile is within 2 %
    assert doc["alone-8192"]["kvgate"]["ttft_p50"] == pytest.approx(0.1691, rel=0.02)
    assert doc["overload"]["kvgate"]["ttft_p99"] > doc["overload"]["kvgate"]["ttft_p50"] > 0.5
    lines = [json.loads(x) for x in (tmp_path / "overload.jsonl").read_text().splitlines()]
    assert len({b for row in lines for b in row["hash_ids"]}) == sum(len(row["hash_ids"]) for row in lines)


def test_trace_or_engine_check_is_required(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--json", str(tmp_path / "x.json")])
