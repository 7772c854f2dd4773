"""The robustness grid: TOML parsing, run caching by input hash, and the per-policy summary math."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.sim import grid as grid_module
from bench.sim.cli import main
from bench.sim.grid import (
    GridError,
    GridSpec,
    WorkloadSpec,
    cells_of,
    default_grid,
    load_grid,
    materialise,
    run_grid,
    run_key,
)
from bench.sim.grid_report import cell_ratios, is_kvgate_variant, summarise
from bench.sim.scenarios import SCENARIOS


def small_spec(**overrides: Any) -> GridSpec:
    values: dict[str, Any] = {
        "workloads": (WorkloadSpec("rag", scenario="rag", requests=60),),
        "loads": (0.6, 1.0),
        "seeds": (1,),
        "workers": (2,),
        "policies": ("round_robin", "least_inflight", "kvgate"),
    }
    values.update(overrides)
    return GridSpec(**values)


def test_a_rerun_computes_only_the_runs_whose_inputs_changed(tmp_path: Path) -> None:
    spec = small_spec()
    first = run_grid(spec, tmp_path, jobs=1, log=lambda _: None)
    assert (first.computed_runs, first.cached_runs) == (6, 0)
    again = run_grid(spec, tmp_path, jobs=1, log=lambda _: None)
    assert (again.computed_runs, again.cached_runs) == (0, 6)
    assert again.cells == first.cells  # the cached runs are the runs
    # one more load: only its 3 runs are new
    more = run_grid(small_spec(loads=(0.6, 1.0, 0.8)), tmp_path, jobs=1, log=lambda _: None)
    assert (more.computed_runs, more.cached_runs) == (3, 6)


def test_a_policy_with_an_index_model_keeps_its_own_run_and_summary(tmp_path: Path) -> None:
    """kvgate@oracle beside kvgate: two runs, two cache entries, two summary rows (not one overwriting the
    other), and a cached re-run gives back the same runs."""
    spec = small_spec(loads=(1.0,), policies=("round_robin", "kvgate", "kvgate@oracle"))
    first = run_grid(spec, tmp_path, jobs=1, log=lambda _: None)
    runs = first.cells[0]["runs"]
    assert [(r["policy"], r.get("index")) for r in runs] == [
        ("round_robin", None), ("kvgate", None), ("kvgate", "oracle")
    ]  # fmt: skip
    again = run_grid(spec, tmp_path, jobs=1, log=lambda _: None)
    assert (again.computed_runs, again.cached_runs) == (0, 3) and again.cells == first.cells
    assert cell_ratios(first.cells[0], "kvgate@oracle")["p99"] is not None
    assert set(summarise(first.cells, spec.policies)) == set(spec.policies)


def test_kvgate_session_without_session_ids_is_kvgates_run_computed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No request sends a session id: kvgate_session routes as kvgate, so one simulation serves both
    names (and a cached re-run gives the same runs); with session ids each policy runs on its own."""
    simulated: list[str] = []
    real_run = grid_module.safe_run

    def counted(policy: str, *args: Any) -> Any:
        simulated.append(policy)
        return real_run(policy, *args)

    monkeypatch.setattr(grid_module, "safe_run", counted)
    spec = small_spec(loads=(1.0,), policies=("kvgate", "kvgate_session", "kvgate@oracle"))
    first = run_grid(spec, tmp_path, jobs=1, log=lambda _: None)
    assert simulated == ["kvgate", "kvgate@oracle"]
    kvgate, session, _ = first.cells[0]["runs"]
    assert session["policy"] == "kvgate_session" and session["metrics"] == kvgate["metrics"]
    assert run_grid(spec, tmp_path, jobs=1, log=lambda _: None).cells == first.cells
    requests = materialise(spec.workloads[0], 1, spec.profile)
    assert grid_module._same_run_as("kvgate_session@exact", requests) == "kvgate@exact"
    with_sessions = [replace(requests[0], session="s1"), *requests[1:]]
    assert grid_module._same_run_as("kvgate_session", with_sessions) == "kvgate_session"


def test_the_cache_key_covers_code_workload_and_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = small_spec()
    cell = cells_of(spec)[0]
    key = run_key(cell, "kvgate", spec)
    assert run_key(cell, "kvgate", spec) == key
    assert run_key(cell, "round_robin", spec) != key
    other = cells_of(small_spec(workers=(3,)))[0]
    assert run_key(other, "kvgate", spec) != key
    bigger = cells_of(small_spec(workloads=(WorkloadSpec("rag", scenario="rag", requests=61),)))[0]
    assert run_key(bigger, "kvgate", spec) != key
    # code that decides kvgate's result changed: its key changes, a peer's does not
    peer_key = run_key(cell, "round_robin", spec)
    original = grid_module.code_digest

    def changed(policy: str) -> str:
        return original(policy) + ("x" if policy == "kvgate" else "")

    monkeypatch.setattr(grid_module, "code_digest", changed)
    assert run_key(cell, "kvgate", spec) != key
    assert run_key(cell, "round_robin", spec) == peer_key


def test_policy_code_digest_follows_the_policy_package() -> None:
    assert grid_module.code_digest("kvgate") == grid_module.code_digest("article")
    assert grid_module.code_digest("kvgate") != grid_module.code_digest("dynamo")
    assert grid_module.code_digest("kvgate@exact") == grid_module.code_digest("kvgate")
    assert grid_module.code_digest("dynamo") == grid_module.code_digest("sglang")


def run(policy: str, p99: float, p50: float, hit: float, slowdown: float, flap: float) -> dict[str, Any]:
    metrics = {"ttft_p99": p99, "ttft_p50": p50, "hit_rate": hit, "slowdown_p99": slowdown, "flap_rate": flap}
    return {"policy": policy, "metrics": metrics, "wall_s": 0.0}


def cell(*runs: dict[str, Any], pooled: float = 0.5) -> dict[str, Any]:
    return {
        "workload": "w",
        "load": 1.0,
        "seed": 1,
        "workers": 2,
        "runs": list(runs),
        "bounds": {"pooled_lru_hit_rate": pooled},
    }


def test_ratios_are_to_the_best_other_policy_excluding_kvgate_variants() -> None:
    c = cell(
        run("kvgate", 2.0, 0.5, 0.45, 3.0, 0.01),
        run("article", 1.0, 0.1, 0.5, 1.0, 0.0),  # a kvgate variant: never a reference
        run("dynamo", 4.0, 0.4, 0.4, 4.0, 0.02),
        run("sglang", 5.0, 1.0, 0.3, 2.5, 0.05),
    )
    kv = cell_ratios(c, "kvgate")
    assert kv["p99"] == pytest.approx(2.0 / 4.0)
    assert kv["p50"] == pytest.approx(0.5 / 0.4)
    assert kv["hit"] == pytest.approx(0.45 / 0.5)
    assert kv["slowdown_best"] == 0.0  # sglang's 2.5 beats 3.0
    dyn = cell_ratios(c, "dynamo")
    assert dyn["p99"] == pytest.approx(4.0 / 5.0)  # against sglang only: kvgate and article excluded
    assert dyn["slowdown_best"] == 0.0
    assert cell_ratios(c, "sglang")["slowdown_best"] == 1.0
    assert (
        is_kvgate_variant("kvgate") and is_kvgate_variant("article") and is_kvgate_variant("kvgate_session")
    )
    assert not is_kvgate_variant("dynamo")


def test_summary_over_cells() -> None:
    cells = [
        cell(run("kvgate", 1.0, 0.1, 0.5, 1.0, 0.00), run("dynamo", 2.0, 0.1, 0.5, 2.0, 0.1)),
        cell(run("kvgate", 3.0, 0.2, 0.4, 1.0, 0.03), run("dynamo", 2.0, 0.1, 0.5, 2.0, 0.1)),
        cell(run("kvgate", 2.0, 0.1, 0.3, 3.0, 0.01), run("dynamo", 2.0, 0.1, 0.5, 2.0, 0.1)),
        cell(run("dynamo", 2.0, 0.1, 0.5, 2.0, 0.1)),  # kvgate missing (failed run): not counted
    ]
    s = summarise(cells, ["kvgate", "dynamo"])["kvgate"]
    assert s["p99_ratio_worst"] == pytest.approx(1.5)
    assert s["p99_ratio_median"] == pytest.approx(1.0)
    assert s["cells_worse_than_best_peer"] == 1
    assert s["p50_ratio_worst"] == pytest.approx(2.0)
    assert s["hit_over_pooled_median"] == pytest.approx(0.8)
    assert s["slowdown_p99_best_share"] == pytest.approx(2 / 3)
    assert s["flap_rate_worst"] == pytest.approx(0.03)
    lone = summarise(cells, ["dynamo"])["dynamo"]  # no other non-kvgate policy: no ratio
    assert lone["p99_ratio_worst"] is None and lone["cells_worse_than_best_peer"] == 0


def test_default_grid_covers_the_issue_cross_product() -> None:
    spec = default_grid(["round_robin"])
    names = [w.name for w in spec.workloads]
    assert names[:4] == ["mooncake_conversation", "mooncake_synthetic", "mooncake_arxiv", "weka_mix"]
    assert set(SCENARIOS) <= set(names)
    assert spec.loads == (0.5, 0.7, 0.8, 0.9, 1.0, 1.2)
    assert spec.seeds == (1, 2, 3) and spec.workers == (8, 16)
    assert len(cells_of(spec)) == len(names) * 6 * 3 * 2


def test_trace_slices_are_seeded(tmp_path: Path) -> None:
    lines = [
        json.dumps(
            {"timestamp": 100 * i, "input_length": 600, "output_length": 5, "hash_ids": [i, 10_000 + i]}
        )
        for i in range(50)
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    w = WorkloadSpec("t", trace=str(tmp_path / "t.jsonl"), requests=10)
    a, b = materialise(w, 1, "h100-llama3.1-8b"), materialise(w, 2, "h100-llama3.1-8b")
    assert len(a) == 10 and [r.id for r in a] == list(range(10))
    assert a == materialise(w, 1, "h100-llama3.1-8b") and a != b


def test_overload_is_thinned_not_truncated() -> None:
    reqs = materialise(WorkloadSpec("overload", scenario="overload", requests=400), 1, "h100-llama3.1-8b")
    assert len(reqs) == 400
    assert reqs[-1].arrival_s > 150.0  # reaches past the burst (at 60-120 s) to the end of the timeline


def write_grid(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(body)
    return path


def test_grid_file_paths_resolve_relative_to_the_file(tmp_path: Path) -> None:
    path = write_grid(tmp_path, 'loads = [0.5]\n[[workload]]\ntrace = "traces/t.jsonl"\nrequests = 10\n')
    spec = load_grid(path, ["round_robin"])
    assert spec.workloads[0].trace == str(tmp_path / "traces" / "t.jsonl")
    assert spec.workloads[0].name == "t" and spec.seeds == (1, 2, 3)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        pytest.param("loads = [0.5]\n", "at least one", id="no workload"),
        pytest.param('bogus = 1\n[[workload]]\nscenario = "rag"\n', "unknown key 'bogus'", id="unknown key"),
        pytest.param('[[workload]]\nscenario = "nope"\n', "unknown scenario", id="bad scenario"),
        pytest.param('[[workload]]\nscenario = "rag"\ntrace = "x"\n', "exactly one", id="both"),
        pytest.param('loads = [0]\n[[workload]]\nscenario = "rag"\n', "loads must be", id="zero load"),
        pytest.param('seeds = [1.5]\n[[workload]]\nscenario = "rag"\n', "seeds must be", id="float seed"),
        pytest.param("[[workload]\n", "not valid TOML", id="broken toml"),
    ],
)
def test_bad_grid_files(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(GridError, match=message):
        load_grid(write_grid(tmp_path, body), ["round_robin"])


def test_cli_writes_grid_json_in_the_interface_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = (
        'loads = [0.8]\nseeds = [1]\nworkers = [2]\n[[workload]]\nscenario = "system_prompt"\nrequests = 40\n'
    )
    path = write_grid(tmp_path, body)
    out = tmp_path / "out"
    argv = ["--grid", str(path), "--out", str(out), "--policies", "round_robin,dynamo,kvgate", "--jobs", "1"]
    assert main(argv) == 0
    doc = json.loads((out / "grid.json").read_text())
    (c,) = doc["cells"]
    assert {k: c[k] for k in ("workload", "load", "seed", "workers")} == {
        "workload": "system_prompt",
        "load": 0.8,
        "seed": 1,
        "workers": 2,
    }
    assert [r["policy"] for r in c["runs"]] == ["round_robin", "dynamo", "kvgate"]
    assert {"ttft_p99", "slowdown_p99", "flap_rate"} <= set(c["runs"][0]["metrics"])
    keys = {
        "p99_ratio_worst",
        "p99_ratio_median",
        "cells_worse_than_best_peer",
        "p50_ratio_worst",
        "hit_over_pooled_median",
        "slowdown_p99_best_share",
        "flap_rate_worst",
    }
    assert set(doc["summary"]) == {"round_robin", "dynamo", "kvgate"}
    assert all(keys <= set(s) for s in doc["summary"].values())
    assert (out / "grid_p99_ratio.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "p99/best worst" in printed
    assert "kvgate per workload:" in printed and "system_prompt" in printed.split("per workload:")[1]
    assert main(["--grid", str(tmp_path / "missing.toml"), "--out", str(out)]) == 2


def test_session_report_compares_kvgate_session_with_kvgate_on_cells_with_sessions() -> None:
    from bench.sim.session_report import report

    def run(policy: str, p99: float, **extra: object) -> dict[str, object]:
        metrics = {"ttft_p99": p99, "ttft_p50": 0.1, "hit_rate": 0.9, **extra}
        return {"policy": policy, "metrics": metrics}

    cell = {"workload": "weka_mix", "load": 1.0, "seed": 1, "workers": 8, "bounds": {}, "runs": [
        run("kvgate", 2.0), run("kvgate_session", 1.0, session_outcomes={"new": 1, "decided": 3}),
        run("dynamo", 4.0),
    ]}  # fmt: skip
    text = report({"cells": [cell, {**cell, "workload": "rag", "runs": [run("kvgate", 1.0)]}]})
    assert "1 cells with sessions (weka_mix)" in text
    assert "p99: worst 0.500" in text and "better in 1, worse in 0" in text
    assert "decided 3 (75.0%)" in text
