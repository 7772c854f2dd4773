"""`kvgate bench gaps` smoke test: one trial per fault and mode against a real agent and emulated worker.

Timing goals live in the benchmark; this checks what must hold whatever the load: with the replay
socket every fault is recovered (the index equals the engine's cache again), and no run leaves stale
entries in the index.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gap_recovery

pytestmark = pytest.mark.e2e


def test_bench_gaps_recovers_every_fault_with_replay_and_leaves_nothing_stale(tmp_path: Path) -> None:
    out = tmp_path / "gaps.json"
    assert gap_recovery.main(["--trials", "1", "--heartbeat-ms", "200", "--json", str(out),
                              "--log-dir", str(tmp_path)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert {(r["replay"], r["fault"]) for r in runs} == {
        (replay, fault) for replay in (True, False) for fault in gap_recovery.FAULTS
    }
    assert all(r["recovered_s"] is not None for r in runs if r["replay"]), runs
    assert all(r["stale_entries"] == 0 for r in runs), runs
    no_replay = {r["fault"]: r for r in runs if not r["replay"]}
    assert no_replay["drop-clear"]["recovered_s"] is not None  # the reset drops the stale entries
    assert no_replay["drop-store"]["recovered_s"] is None  # the lost blocks cannot come back
    assert no_replay["drop-last"]["recovered_s"] is None  # nothing shows the loss
