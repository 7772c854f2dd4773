"""CI's 60-second `kvgate bench chaos`: two gateways, one Redis, 4 workers and agents, >= 5 faults of
>= 4 kinds (worker/agent/gateway SIGKILL, Redis SIGSTOP, Redis restart); the invariants hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import chaos

pytestmark = pytest.mark.e2e


def test_chaos_60_seconds(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    assert chaos.main(["--seconds", "60", "--json", str(out), "--log-dir", str(tmp_path / "logs")]) == 0
    result = json.loads(out.read_text())
    assert sum(result["faults"].values()) >= 5 and len(result["faults"]) >= 4, result["faults"]
    assert result["status_500"] == 0
    assert result["lost"] == 0
    assert result["duplicated"] == 0
    assert result["slots_leaked"] == 0
    # the goal is 0, now measured exactly from the workers' start/end logs; the causes of the 1 measured
    # before are fixed (docs/REDIS.md "After a Redis restart or stall", plugin/release.py ABORT_GRACE_S),
    # but no locked run has shown 0 yet: tighten to == 0 once one has (docs/BENCHMARKS.md, session 4)
    assert result["max_quota_overshoot"] <= 1
    assert result["quota_enforced_after_redis_restart"] is True
    assert result["max_recovery_s"] <= result["lease_period_s"]
    assert result["sent"] > 100
