"""`kvgate bench sim` end to end on a small scenario: results.json schema, determinism, plots, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim.cli import main
from bench.sim.registry import POLICIES, UnknownPolicy, available_policies, resolve_policies

BASELINES = "round_robin,random,least_inflight"
SCHEMA_METRICS = {
    "hit_rate",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "e2e_p50",
    "e2e_p99",
    "queue_p50",
    "queue_p99",
    "throughput_rps",
    "throughput_tok_s",
    "util_cv",
    "switch_rate",
}


def run(tmp_path: Path, name: str, *extra: str) -> dict[str, object]:
    out = tmp_path / name
    argv = ["--scenario", "multi_tenant", "--limit", "200", "--workers", "4", "--policies", BASELINES]
    assert main([*argv, "--jobs", "1", "--out", str(out), *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_results_json_schema_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run(tmp_path, "a")
    assert {"trace", "workers", "load", "bounds", "runs"} <= set(doc)
    assert doc["trace"] == "scenario:multi_tenant" and doc["workers"] == 4 and doc["load"] == 0.8
    assert set(doc["bounds"]) == {"infinite_hit_rate", "pooled_lru_hit_rate"}  # type: ignore[arg-type]
    runs = doc["runs"]
    assert isinstance(runs, list)
    assert [r["policy"] for r in runs] == BASELINES.split(",")
    for r in runs:
        assert set(r["metrics"]) >= SCHEMA_METRICS
        assert all(isinstance(r["metrics"][k], float) for k in SCHEMA_METRICS)
        assert 0.0 <= r["metrics"]["hit_rate"] <= doc["bounds"]["infinite_hit_rate"] + 1e-9  # type: ignore[index]
    for png in ("ttft_cdf.png", "hit_rate.png", "load_over_time.png"):
        assert (tmp_path / "a" / png).read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "least_inflight" in table and "pooled-LRU" in table


def test_same_seed_same_results(tmp_path: Path) -> None:
    first, second = run(tmp_path, "a", "--no-plots"), run(tmp_path, "b", "--no-plots")
    assert [r["metrics"] for r in first["runs"]] == [r["metrics"] for r in second["runs"]]  # type: ignore[union-attr]


def test_sweep_writes_ttft_p99_per_load(tmp_path: Path) -> None:
    run(tmp_path, "s", "--no-plots", "--sweep", "--sweep-loads", "0.5,1.0")
    sweep = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert sweep["loads"] == [0.5, 1.0]
    assert set(sweep["policies"]) == set(BASELINES.split(","))
    assert all(len(v["ttft_p99"]) == 2 for v in sweep["policies"].values())
    assert (tmp_path / "s" / "load-0.5" / "results.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--trace", "/nonexistent.jsonl"], "cannot open trace", id="missing trace"),
        pytest.param(["--scenario", "nope"], "unknown scenario 'nope'", id="unknown scenario"),
        pytest.param(
            ["--scenario", "rag", "--policies", "nope"], "unknown policy 'nope'", id="unknown policy"
        ),
        pytest.param(["--scenario", "rag", "--load", "0"], "--load must be > 0", id="zero load"),
        pytest.param(["--scenario", "rag", "--profile", "nope"], "nope", id="unknown profile"),
        pytest.param([], "give --trace PATH, --scenario NAME", id="no workload"),
        pytest.param(["--scenario", "rag", "--bogus"], "unrecognized arguments", id="unknown flag"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_list_scenarios_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list-scenarios"]) == 0
    assert "multi_turn" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "--sweep" in capsys.readouterr().out


def test_registry_names_and_lazy_failures() -> None:
    assert list(POLICIES)[:3] == ["round_robin", "random", "least_inflight"]
    assert resolve_policies("random, round_robin") == ["random", "round_robin"]
    assert {"round_robin", "random", "least_inflight"} <= set(available_policies())
    assert resolve_policies("all") == available_policies()
    with pytest.raises(UnknownPolicy, match="unknown policy"):
        resolve_policies("round_robin,bogus")


def test_a_policy_name_may_carry_its_index_model_as_in_the_grid_files() -> None:
    """`kvgate@exact` in --policies or a grid's `policies` (one run per index model, like --index)."""
    assert resolve_policies("dynamo,kvgate@exact") == ["dynamo", "kvgate@exact"]
    with pytest.raises(UnknownPolicy, match="--index takes"):
        resolve_policies("kvgate@bogus")
    with pytest.raises(UnknownPolicy, match="applies to"):
        resolve_policies("dynamo@exact")
