"""`kvgate bench scale` smoke test with tiny sizes: every section runs and the JSON has the interface's keys.

Needs: the embedded redis-server binary, free loopback ports; real gateway processes (--processes 1, 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import REPO

pytestmark = pytest.mark.e2e


def test_bench_scale_tiny(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "plugin.cli", "bench", "scale", "--json", str(out), "--workers", "8,200",
           "--entries", "2000", "--decisions", "50", "--processes", "2", "--seconds", "0.5",
           "--concurrency", "4", "--redis-workers", "10", "--requests", "10"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [d["workers"] for d in report["decision"]] == [8, 200]
    assert all(d["index_entries"] >= 2000 for d in report["decision"])
    assert all(0 < d["p50"] <= d["p99"] for d in report["decision"])
    assert [p["n"] for p in report["processes"]] == [2] and all(p["rps"] > 0 for p in report["processes"])
    assert report["redis_bytes_per_worker"] > 0
    assert report["round_trips_per_request"] >= 1  # at least the admission script
