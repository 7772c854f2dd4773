"""`kvgate bench live`, tiny: 2 emulated workers, a 16-request tenants workload, kvgate and the
round-robin forwarder (plus sglang-router when its virtualenv is already built: building peers' venvs
is a bench-only step, too slow for CI). Asserts the interface and the counters, never timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.live import main
from bench.live_routers import PEERS_DIR, PeerUnavailable, peer_venv

pytestmark = pytest.mark.e2e


def _sglang_ready() -> bool:
    try:
        peer_venv("sglang", PEERS_DIR, install=False)
    except PeerUnavailable:
        return False
    return True


def test_bench_live_writes_the_interface_for_each_router(tmp_path: Path) -> None:
    routers = ["kvgate", "round_robin"] + (["sglang"] if _sglang_ready() else [])
    out = tmp_path / "results.json"
    argv = ["--json", str(out), "--out", str(tmp_path), "--workers", "2", "--requests", "16",
            "--passes", "2", "--loads", "0.5", "--workloads", "tenants", "--routers", ",".join(routers),
            "--max-output", "16", "--no-plots"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["passes"] == 2 and doc["slo_ttft_s"] == 2.0
    runs = doc["runs"]
    assert sorted((r["router"], r["pass"]) for r in runs) == sorted((r, p) for r in routers for p in (1, 2))
    # even passes run the routers in reverse order
    assert [r["router"] for r in runs if r["pass"] == 2] == list(reversed(routers))
    keys = {"router", "workload", "load", "pass", "ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p99",
            "hit_rate", "throughput_rps", "goodput_rps", "errors", "worker_share"}  # fmt: skip
    for run in runs:
        assert keys <= set(run), run
        assert run["errors"] == 0 and run["requests"] == 16
        assert run["workload"] == "tenants" and run["load"] == 0.5
        assert 0 < run["ttft_p50"] <= run["ttft_p90"] <= run["ttft_p99"] <= run["e2e_p99"]
        assert 0 <= run["goodput_rps"] <= run["throughput_rps"]
        # every request reached a worker, counted by the workers themselves (caches reset in between)
        assert len(run["worker_share"]) == 2 and abs(sum(run["worker_share"]) - 1) < 1e-9
        assert 0 < run["hit_rate"] < 1  # the tenants share system prompts
    rr = [r for r in runs if r["router"] == "round_robin"]
    assert all(abs(r["worker_share"][0] - 0.5) < 1e-9 for r in rr)  # strict alternation, 16 requests
    trace = tmp_path / "trace-tenants-0.5.jsonl"
    assert len(trace.read_text().splitlines()) == 16  # the same requests, for kvgate bench sim --trace
