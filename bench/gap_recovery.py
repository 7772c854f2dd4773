"""Gap recovery: after an injected KV-event fault, how long until the agent's index is correct again.

`kvgate bench gaps [--heartbeat-ms 500] [--trials 3] [--json PATH]`

Per mode (with vLLM's replay socket, without one) an emulated worker with KV events and a real
`kvgate agent --kv-events` process over an embedded Redis. Each trial warms a fresh prefix, then
injects one fault on the worker's publisher (`POST /kvgate/kv_faults`) and sends the next request:
  drop-store   the batch storing a request's blocks is lost, the next request's batch shows the gap;
  drop-last    the same, with no request after it (only the agent's idle replay probe can see it);
  drop-clear   the AllBlocksCleared batch of a cache reset is lost (stale entries if not recovered);
  duplicate    a batch is sent twice;
  reorder      a batch is held back and sent after the next one.
The truth is what the emulated engine holds (its cache is far larger than the prompts: no eviction).
Recovery time: from sending the request after the fault (drop-last: the lost one) until the worker's
Redis index equals the truth (polled every 5 ms). An index that loses entries it cannot get back (a
reset without replay) is never equal: the run reports it as not recovered, with the share of the truth
it still holds. (After a
reset without replay the agent cannot key a new block whose parent it forgot, so a prefix that extends
blocks cached before the gap stays out of the index until the engine evicts those blocks.)
Goal (issue 13): recovered within one heartbeat period.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.emulator.server import EmulatorConfig, start_emulator
from bench.emulator.tokenizer import render_chat, tokenize
from bench.stack import stop_process
from policy.prefix import token_block_hashes
from store import index_store, registry
from store.redis_server import EmbeddedRedis, free_port

MODEL = "m"
BLOCK = 16
FAULTS = ("drop-store", "drop-last", "drop-clear", "duplicate", "reorder")
POLL_S = 0.005


def body(text: str) -> dict[str, Any]:
    system = f"{text}: you answer questions about the ACME rocket catalogue. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


def keys_of(request: dict[str, Any]) -> set[int]:
    """The index keys the agent writes for this request's prompt blocks."""
    return set(
        token_block_hashes(tokenize(render_chat(request["messages"])), model=MODEL, block_size=BLOCK)[0]
    )


async def held(redis: aioredis.Redis, worker: str) -> set[int]:
    return set((await index_store.load_snapshot(redis, MODEL)).get(worker, ()))


async def wait_until(
    redis: aioredis.Redis, worker: str, truth: set[int], limit_s: float
) -> tuple[float | None, set[int]]:
    """Seconds until the worker's index equals `truth` (None if not within `limit_s`), and the last index."""
    started = time.perf_counter()
    index: set[int] = set()
    while time.perf_counter() - started < limit_s:
        index = await held(redis, worker)
        if index == truth:
            return time.perf_counter() - started, index
        await asyncio.sleep(POLL_S)
    return None, index


async def run_mode(
    replay: bool, heartbeat_ms: int, trials: int, redis_url: str, log: Path
) -> list[dict[str, Any]]:
    worker = "replay" if replay else "no-replay"
    pub = f"tcp://127.0.0.1:{free_port()}"
    rep = f"tcp://127.0.0.1:{free_port()}" if replay else None
    runner, port = await start_emulator(
        EmulatorConfig(model=MODEL, worker_id=worker, time_scale=0.02, kv_events_endpoint=pub,
                       kv_events_replay_endpoint=rep)
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    args = ["agent", "--worker-url", url, "--model", MODEL, "--worker-id", worker, "--redis", redis_url,
            "--heartbeat-ms", str(heartbeat_ms), "--kv-events", pub,
            "--router-block-size", str(BLOCK)]  # fmt: skip
    if rep:
        args += ["--kv-events-replay", rep]
    with (log / f"agent-{worker}.log").open("wb") as out:
        agent = subprocess.Popen([sys.executable, "-m", "plugin.cli", *args], stdout=out, stderr=out)
    redis = aioredis.Redis.from_url(redis_url)
    limit_s = max(2.0, 10 * heartbeat_ms / 1000)  # 'not recovered' after this long
    results = []
    try:
        async with aiohttp.ClientSession() as http:

            async def send(request: dict[str, Any] | None, path: str = "/v1/chat/completions") -> None:
                async with http.post(url + path, json=request) as response:
                    assert response.status == 200, await response.text()

            deadline = time.monotonic() + 20
            while not any(r.id == worker for r in await registry.read_workers(redis, MODEL, 0)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"agent {worker} did not register (log: {log})")
                await asyncio.sleep(0.05)
            truth: set[int] = set()
            for trial in range(trials):
                for fault in FAULTS:
                    tag = f"{worker}-{fault}-{trial}"
                    first = body(f"{tag} first")
                    await send(first)
                    truth |= keys_of(first)
                    settled, _ = await wait_until(redis, worker, truth, limit_s)
                    if settled is None:  # an earlier unrecovered reset: start from what the index has
                        truth = await held(redis, worker)
                    kind = fault.split("-")[0]
                    await send({kind: 1}, "/kvgate/kv_faults")
                    if fault == "drop-clear":
                        await send(None, "/reset_prefix_cache")  # its AllBlocksCleared is the lost batch
                        truth = set()
                    else:
                        lost = body(f"{tag} faulted")
                        sent = time.perf_counter()
                        await send(lost)
                        truth |= keys_of(lost)
                    if fault != "drop-last":
                        after = body(f"{tag} after")
                        sent = time.perf_counter()
                        await send(after)
                        truth |= keys_of(after)
                    took, index = await wait_until(redis, worker, truth, limit_s)
                    if took is not None:
                        took = time.perf_counter() - sent  # from sending the request, not from its reply
                    results.append({
                        "replay": replay, "fault": fault, "trial": trial,
                        "recovered_s": None if took is None else round(took, 4),
                        "within_heartbeat": took is not None and took <= heartbeat_ms / 1000,
                        "stale_entries": len(index - truth),
                        "index_size": len(index), "truth_size": len(truth),
                        "truth_held": round(len(index & truth) / len(truth), 3) if truth else 1.0,
                    })  # fmt: skip
                    if took is None:
                        truth = index & truth  # what can still be checked from here on
    finally:
        await redis.aclose()
        stop_process(agent, 5)
        await runner.cleanup()
    return results


def summary(rows: Sequence[dict[str, Any]], heartbeat_ms: int) -> list[str]:
    lines = [f"heartbeat {heartbeat_ms} ms; recovery: request after the fault -> index = the engine's cache"]
    head = f"{'mode':<10} {'fault':<11} {'recovered':>9} {'p50 ms':>8} {'max ms':>8} {'in 1 hb':>7}"
    lines.append(f"{head} {'truth held':>10}")
    for replay in (True, False):
        for fault in FAULTS:
            cell = [r for r in rows if r["replay"] == replay and r["fault"] == fault]
            if not cell:
                continue
            times = sorted(r["recovered_s"] for r in cell if r["recovered_s"] is not None)
            p50 = f"{1000 * times[len(times) // 2]:.0f}" if times else "-"
            worst = f"{1000 * times[-1]:.0f}" if times else "-"
            within = sum(r["within_heartbeat"] for r in cell)
            held_share = min(r["truth_held"] for r in cell)
            mode = "replay" if replay else "no replay"
            lines.append(f"{mode:<10} {fault:<11} {len(times):>4}/{len(cell):<4} {p50:>8} {worst:>8} "
                         f"{within:>3}/{len(cell):<3} {held_share:>10.2f}")  # fmt: skip
    return lines


async def run(heartbeat_ms: int, trials: int, log_dir: Path) -> dict[str, Any]:
    redis = EmbeddedRedis().start()
    try:
        rows = []
        for replay in (True, False):
            rows += await run_mode(replay, heartbeat_ms, trials, redis.url, log_dir)
    finally:
        redis.stop()
    return {"heartbeat_ms": heartbeat_ms, "trials": trials, "runs": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench gaps", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--heartbeat-ms", type=int, default=500, help="the agent's heartbeat period (default 500)"
    )
    parser.add_argument("--trials", type=int, default=3, help="trials per mode and fault (default 3)")
    parser.add_argument("--json", default="", help="write the result here")
    parser.add_argument("--log-dir", default="", help="agent logs (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.heartbeat_ms < 50 or args.trials < 1:
        parser.error("--heartbeat-ms must be >= 50 and --trials >= 1")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvgate-gaps-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args.heartbeat_ms, args.trials, log_dir))
    print("\n".join(summary(result["runs"], args.heartbeat_ms)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
