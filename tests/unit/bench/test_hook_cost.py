"""bench/hook_cost.py runs KvGate's hooks end to end on its own embedded Redis and releases every lease."""

from __future__ import annotations

import pstats
import re
from pathlib import Path

import pytest

from bench import hook_cost


def test_small_run_reports_and_profiles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "hooks.prof"
    assert hook_cost.main(["--requests", "40", "--concurrency", "4", "--profile", str(profile)]) == 0
    line = capsys.readouterr().out
    found = re.search(r"40 requests, concurrency 4: (\d+) µs CPU per request .* releases (\d+)\)", line)
    assert found is not None, line
    assert 5 <= int(found[1]) <= 1_000_000  # hooks cost CPU: more than nothing, less than a second each
    assert int(found[2]) == 240  # 200 warm-up + 40 measured, each released once
    assert pstats.Stats(str(profile)).total_calls > 0
