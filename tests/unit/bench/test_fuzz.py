"""`kvgate bench fuzz` runs atheris over the intake for a bounded time and finds no crash."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import fuzz


def test_fuzz_runs_bounded_and_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("atheris")
    assert fuzz.main(["--seconds", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "inputs" in out and "exit 0" in out
    assert not list(tmp_path.glob("crash-*"))
