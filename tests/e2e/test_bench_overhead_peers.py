"""`kvgate bench overhead --method vllm-router` smoke test (kvgate only: the peers' virtualenvs are not
built in CI): every cell runs through real mock workers and a real gateway, the added latency is
taken against direct, and CPU per 1,000 requests is read for the gateway's process tree and Redis.

Needs: the embedded redis-server binary, free loopback ports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.overhead_peers import Corpus
from tests.e2e.harness import REPO

pytestmark = pytest.mark.e2e


def test_corpora_have_the_methods_shape() -> None:
    hot, cold = Corpus("hot64", 200), Corpus("cold", 2048)
    assert hot.body(3) == hot.body(3 + 64) and hot.body(3) != hot.body(4)
    prompts = [json.loads(cold.body(i))["messages"][0]["content"] for i in (0, 1, 256)]
    assert all(len(p.encode()) == 2048 for p in prompts)
    assert prompts[0][:16] != prompts[1][:16] != prompts[2][:16]  # a unique marker first: no shared prefix
    body = json.loads(hot.body(0))
    assert body["max_tokens"] == 16 and "stream" not in body and len(body["messages"]) == 1


def test_overhead_vllm_router_method_kvgate(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, "-m", "plugin.cli", "bench", "overhead", "--method", "vllm-router", "--routers",
           "kvgate", "--sizes", "200", "--concurrency", "1,4", "--warmup", "0.2", "--seconds", "0.6",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert {(c["target"], c["corpus"], c["concurrency"]) for c in cells} == {
        (t, corpus, conc) for t in ("direct", "kvgate") for corpus in ("hot64", "cold") for conc in (1, 4)
    }
    assert all(c["errors"] == 0 and c["requests"] > 0 for c in cells)
    for c in (c for c in cells if c["target"] == "kvgate"):
        assert c["p50_minus_direct_ms"] is not None and c["cpu_ms_per_1k"] > 0
        assert c["redis_cpu_ms_per_1k"] is not None
    assert set(report["summary"]) == {"kvgate@c1", "kvgate@c4"}
    assert "added p50" in done.stdout
