"""Every panel of the shipped Grafana dashboard returns data from a real Prometheus.

A real Prometheus (1 s scrapes) scrapes a running stack: real redis-server, two emulated vLLM workers,
their node agents and one `kvgate proxy` (mitmdump + addon), all real processes (bench/stack.py). Load
arrives in bursts above the quota, over a few shared prefixes, a share of it low priority that may
not wait: so requests hit caches, queue, and get refused. Then every panel query of the dashboard
JSON shipped in helm/ (the same file as examples/, checked by tests/unit/bench/test_dashboard.py),
with Grafana's variables filled in as Grafana would, is evaluated through the Prometheus HTTP API and
must return at least one finite value.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest

from bench.dashboard import SHIPPED, queries
from bench.live_scenarios import filler_text
from bench.loadgen import LiveRequest, run_open_loop
from bench.stack import Stack
from store.redis_server import free_port
from tests.e2e.prometheus import BINARY, MISSING, PrometheusServer, finite_values

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(BINARY is None, reason=MISSING)]

MODEL = "llama"
WORKERS = 2
PER_WORKER = 2  # quota = 4 concurrent requests: the bursts of 8 queue and get refused
BURSTS = 8  # one a second
BURST_SIZE = 8
MAX_TOKENS = 160  # long enough that the agents (250 ms probes) and 1 s scrapes see requests running
# what Grafana substitutes: $model with "All" selected is the allValue, the rate window spans the run
VARIABLES = {"$model": ".*", "$__rate_interval": "1m"}


def load(rng: random.Random) -> list[LiveRequest]:
    prefixes = [filler_text(rng, 400) for _ in range(3)]
    out = []
    for burst in range(BURSTS):
        for i in range(BURST_SIZE):
            low = (
                i >= BURST_SIZE - 2
            )  # the burst's last two: low priority that may not wait, refused (quota full)
            headers = {"x-kvgate-priority": "low", "x-kvgate-max-wait-ms": "0"} if low else {}
            text = f"{rng.choice(prefixes)}\n\nquestion {burst}-{i}: {filler_text(rng, 20)}"
            body = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": text}]}
            out.append(LiveRequest(send_at_s=burst + 0.01 * i, body=body, headers=headers))
    return out


def fill(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


async def test_every_dashboard_panel_returns_data_from_a_real_prometheus(tmp_path: Path) -> None:
    started = time.monotonic()
    board = json.loads(SHIPPED[0].read_text())
    panel_queries = queries(board)
    assert len(panel_queries) >= 10
    stack = Stack(log_dir=tmp_path / "logs")
    prom: PrometheusServer | None = None
    try:
        stack.start_redis()
        agent_ports = []
        for i in range(WORKERS):
            url = stack.start_worker(f"w{i}", model=MODEL, profile="h100-llama3.1-8b", time_scale=0.5)
            agent_ports.append(free_port())
            stack.start_agent(f"w{i}", url, model=MODEL, extra=[
                "--max-concurrency", str(PER_WORKER), "--heartbeat-ms", "250", "--port", str(agent_ports[-1]),
            ])  # fmt: skip
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[admission]\naudit_every_ms = 1000\n\n[models."{MODEL}"]\ntotal = {WORKERS * PER_WORKER}\n'
        )
        gateway = stack.start_gateway("g0", config=config, extra=["--gateway-id", "g0"])
        prom = PrometheusServer(tmp_path / "prometheus", {
            "kvgate-gateway": [stack.metrics_urls[gateway].removeprefix("http://")],  # the metrics port
            "kvgate-agent": [f"127.0.0.1:{p}" for p in agent_ports],
        }).start()  # fmt: skip

        results = await run_open_loop(gateway, load(random.Random(7)), timeout_s=60)
        statuses = sorted({r.status for r in results})
        assert any(r.ok for r in results), statuses
        # low requests that may not wait are refused: 429 quota, or 503 worker_full (both workers full)
        assert {429, 503} & set(statuses), f"the load never filled the quota: {statuses}"

        async def scraped_after_load() -> bool:  # two scrapes after the last response (rates need both)
            found = prom.query(f'sum(kvgate_requests_total{{model="{MODEL}"}})')
            return bool(found) and finite_values(found)[0] >= len(results)

        seen_running = prom.query("max_over_time(kvgate_agent_worker_running[1m])")
        print("running seen by the scrapes:", seen_running)
        deadline = time.monotonic() + 15
        while not await scraped_after_load():
            assert time.monotonic() < deadline, "Prometheus never scraped the finished load"
            await asyncio.sleep(0.25)
        await asyncio.sleep(2.2)

        assert set(prom.targets_up().values()) == {"up"}, prom.targets_up()
        models = prom.api("label/model/values", **{"match[]": "kvgate_requests_total"})
        assert MODEL in models  # the $model variable's options
        empty: dict[str, object] = {}
        for title, expr in panel_queries:
            result = prom.query(fill(expr))
            if not finite_values(result):
                empty[f"{title}: {expr}"] = result
        assert not empty, "panels without data:\n" + "\n".join(f"{k} -> {v}" for k, v in empty.items())
    except BaseException:
        for log in sorted((tmp_path / "logs").glob("*.log")):
            print(f"---- {log.name} ----\n{log.read_text(errors='replace')[-3000:]}")
        if prom is not None and prom.log.exists():
            print(f"---- prometheus ----\n{prom.log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        if prom is not None:
            prom.stop()
        stack.close()
        print(f"dashboard e2e took {time.monotonic() - started:.1f} s")
