"""Operator tools against a real recorded run: the demo's stack (embedded Redis, 4 emulated workers
with agents, a real gateway writing its decision log), a short slice of the demo's traffic, then a
same-prefix burst (load moves) and a burst with a tiny wait budget (429s). Then:

- `kvgate explain` tells a cache hit, a load-driven move and a 429 in plain words, and summarises a
  worker (`--worker`), from Redis and from the file alike;
- `kvgate bench replay` re-runs the recorded traffic in the simulator: its kvgate run's hit rate is
  within 5 points of the recorded one;
- `kvgate top` under tmux shows the workers, queues and last decisions a person would look at.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import load_move
from bench.ab import start_demo_stack, wait_for_records
from bench.live_scenarios import TenantPromptsScenario
from bench.loadgen import LiveRequest, run_open_loop
from bench.stack import Stack
from plugin.explain import classify

pytestmark = pytest.mark.e2e

SCENARIO = TenantPromptsScenario(requests=64, rate_rps=8.0)
TOTAL = 24  # the model's concurrent requests: the 429 burst overflows it


def kvgate(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plugin.cli", *args], capture_output=True, text=True, timeout=timeout_s
    )


def burst(text: str, n: int, *, wait_ms: int | None = None, max_tokens: int = 64) -> list[LiveRequest]:
    return load_move.burst(text, n, max_tokens, model=SCENARIO.model, wait_ms=wait_ms)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("ops")
    with Stack(log_dir=work) as stack:
        try:
            gateway, decisions = start_demo_stack(
                stack, work, SCENARIO.model, f'[models."{SCENARIO.model}"]\ntotal = {TOTAL}\n'
            )
            results = asyncio.run(run_open_loop(gateway, SCENARIO.build()))
            demo = wait_for_records(decisions, len(results))
            # one worker caches the hot prefix first; a burst of it then overloads that worker
            extra = asyncio.run(run_open_loop(gateway, burst("warm question", 1)))
            extra += asyncio.run(run_open_loop(gateway, burst("hot question", 39)))
            extra += asyncio.run(run_open_loop(gateway, burst("rushed question", 60, wait_ms=1)))
            records = wait_for_records(decisions, len(results) + len(extra))
            yield {"stack": stack, "gateway": gateway, "file": decisions, "demo": demo, "records": records,
                   "work": work, "statuses": sorted({r.status for r in results + extra})}  # fmt: skip
        except BaseException:
            for log in sorted(work.glob("*.log")):
                print(f"---- {log.name} ----\n{log.read_text(errors='replace')[-2000:]}")
            raise


def first(records: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    kinds = {"moved": ("load_move", "replicate")}  # away from the cache because of load
    for r in records:
        if kind == "429" and r.get("status") == 429:
            return r
        if kind != "429" and r.get("worker") and classify(r).kind in kinds.get(kind, (kind,)):
            return r
    raise AssertionError(f"no {kind} in {len(records)} records")


def test_every_request_has_one_record_refused_ones_too(recorded: dict[str, Any]) -> None:
    records = recorded["records"]
    assert 429 in recorded["statuses"], recorded["statuses"]
    ids = [r["request_id"] for r in records]
    assert len(ids) == len(set(ids)) == 64 + 40 + 60
    refused = [r for r in records if r["status"] == 429]
    assert refused and all(r["worker"] is None and r["refused_by"] == "admission" for r in refused)
    assert all(r["reason"] == "wait_budget" for r in refused)
    assert all("prompt_text" not in r and len(r["prefix_hashes"]) == len(r["block_tokens"]) for r in records)


def test_explain_tells_a_cache_hit_a_load_move_and_a_429(recorded: dict[str, Any]) -> None:
    redis_url = recorded["stack"].redis_url
    hit = first(recorded["records"], "cache_hit")
    out = kvgate("explain", hit["request_id"], "--redis", redis_url)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    assert f"sent to {hit['worker']}, a CACHE HIT" in out.stdout
    assert "reused" in out.stdout and "prompt tokens from its cache" in out.stdout

    moved = first(recorded["records"], "moved")
    out = kvgate("explain", moved["request_id"], "--file", str(recorded["file"]))
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    assert "MOVED AWAY FROM THE CACHE" in out.stdout, out.stdout

    refused = first(recorded["records"], "429")
    out = kvgate("explain", refused["request_id"], "--redis", redis_url, "--json")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    print(document["story"])
    assert "REFUSED by admission control with HTTP 429" in document["story"]
    assert "wait budget" in document["story"]

    missing = kvgate("explain", "no-such-request", "--redis", redis_url)
    assert missing.returncode == 1 and "no decision record" in missing.stderr


def test_explain_worker_summary(recorded: dict[str, Any]) -> None:
    moved = first(recorded["records"], "moved")
    holder = classify(moved).best_worker
    assert holder is not None
    out = kvgate("explain", "--worker", holder, "--since", "10m", "--redis", recorded["stack"].redis_url)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    assert f"Worker {holder}, last 10 min" in out.stdout
    assert "Why requests went AWAY from it:" in out.stdout and "because of load" in out.stdout


def test_replay_of_the_recorded_demo_reproduces_its_hit_rate(
    recorded: dict[str, Any], tmp_path: Path
) -> None:
    demo = tmp_path / "demo.jsonl"
    demo.write_text("".join(json.dumps(r) + "\n" for r in recorded["demo"]))
    out_json = tmp_path / "replay.json"
    out = kvgate("bench", "replay", str(demo), "--policies", "kvgate,round_robin", "--json", str(out_json))
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    document = json.loads(out_json.read_text())
    runs = {r["policy"]: r["metrics"] for r in document["runs"]}
    assert [r["policy"] for r in document["runs"]] == ["recorded", "kvgate", "round_robin"]
    assert document["workers"] == 4 and document["requests"] == 64
    assert abs(runs["kvgate"]["hit_rate"] - runs["recorded"]["hit_rate"]) <= 0.05, runs
    assert runs["round_robin"]["hit_rate"] < runs["kvgate"]["hit_rate"]
    assert out.stdout.splitlines()[2].startswith("recorded")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
def test_top_under_tmux_shows_what_an_operator_looks_at(recorded: dict[str, Any]) -> None:
    session = f"kvgate-top-{int(time.time() * 1000)}"
    # COLUMNS/LINES: a tmux server already running (another session) may size new windows its own way
    command = (
        f"env COLUMNS=160 LINES=50 {sys.executable} -m plugin.cli top --redis {recorded['stack'].redis_url}"
    )
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50", command], check=True)
    try:
        deadline = time.monotonic() + 20
        screen = ""
        while time.monotonic() < deadline:
            time.sleep(0.5)
            screen = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if "Last decisions" in screen and "w3" in screen:
                break
        print(screen)
        assert "kvgate top" in screen and SCENARIO.model in screen
        for worker in ("w0", "w1", "w2", "w3"):
            assert worker in screen
        for heading in ("Workers", "lease", "in flight", "KV", "hit", "share", "Queues", "Last decisions"):
            assert heading in screen, heading
        assert "429" in screen or "200" in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


def test_bench_ab_reports_both_arms_from_one_live_run(tmp_path: Path) -> None:
    out_json = tmp_path / "ab.json"
    out = kvgate(
        "bench", "ab", "--candidate", "round_robin", "--share", "0.5", "--requests", "32", "--rate", "10",
        "--json", str(out_json), timeout_s=120,
    )  # fmt: skip
    print(out.stdout, out.stderr[-2000:])
    assert out.returncode == 0, out.stderr
    arms = json.loads(out_json.read_text())["arms"]
    assert [(a["arm"], a["policy"], a["share"]) for a in arms] == [
        ("default", "kvgate", 0.5),
        ("candidate", "round_robin", 0.5),
    ]
    keys = ("hit_rate", "ttft_p50", "ttft_p99", "util_cv", "throughput_rps", "queue_p99")
    for arm in arms:
        assert arm["requests"] > 0 and all(isinstance(arm[k], float) for k in keys), arm
