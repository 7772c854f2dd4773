"""bench/hook_cost.py runs KvGate's hooks end to end on its own embedded Redis and releases every lease."""

from __future__ import annotations

import json
import math
import pstats
import re
from pathlib import Path

import pytest

from bench import hook_cost, hook_cost_ab


def test_small_run_reports_and_profiles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "hooks.prof"
    assert hook_cost.main(["--requests", "40", "--concurrency", "4", "--profile", str(profile)]) == 0
    line = capsys.readouterr().out
    found = re.search(r"40 requests, concurrency 4: (\d+) µs CPU per request .* releases (\d+)\)", line)
    assert found is not None, line
    assert 5 <= int(found[1]) <= 1_000_000  # hooks cost CPU: more than nothing, less than a second each
    assert int(found[2]) == 240  # 200 warm-up + 40 measured, each released once
    assert pstats.Stats(str(profile)).total_calls > 0


def test_rounds_are_reported_each_and_summarized(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rounds.json"
    assert hook_cost.main(["--requests", "20", "--rounds", "3", "--gc", "off", "--json", str(out)]) == 0
    line = capsys.readouterr().out
    assert re.search(r"3 rounds: median \d+, min \d+, max \d+", line), line
    assert "releases 260)" in line  # 200 warm-up + 3 rounds of 20
    result = json.loads(out.read_text())
    rounds = result["rounds_us_per_request"]
    assert len(rounds) == 3 and all(r > 0 for r in rounds)
    assert result["min"] == min(rounds) and result["median"] == sorted(rounds)[1]
    assert all(user >= 0 and system >= 0 for user, system in result["rounds_user_system"])


def test_the_ab_driver_runs_this_tree_against_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(hook_cost.__file__).resolve().parents[1]
    out = tmp_path / "ab.json"
    argv = [
        "--tree",
        f"a={root}",
        "--tree",
        f"b={root}",
        "--batches",
        "1",
        "--rounds",
        "2",
        "--requests",
        "20",
    ]
    assert hook_cost_ab.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [len(result["rounds"][n]) for n in ("a", "b")] == [2, 2]
    assert result["trees"]["b"]["paired_ratio_median"] > 0
    assert len(result["trees"]["b"]["batch_paired_medians"]) == 1  # one batch: one paired median
    assert "paired ratio median" in capsys.readouterr().out


def test_median_interval_is_the_binomial_order_statistics() -> None:
    # n = 20: the 6th and 15th smallest (P(Binomial(20, 1/2) <= 5) = 0.021 <= 0.025 < P(<= 6) = 0.058)
    assert hook_cost_ab.median_interval([float(x) for x in range(20, 0, -1)]) == (6.0, 15.0)
    low, high = hook_cost_ab.median_interval([1.0] * 5)  # too few values for a 95 % interval
    assert math.isnan(low) and math.isnan(high)
