"""The node agent end to end: `kvgate agent` and `kvgate drain` as real processes; real Redis, HTTP, ZMQ.

Needs: the session's embedded redis-server (tests/conftest.py). The worker is a small aiohttp app in
this module that serves vLLM-format /metrics, /health, /v1/models and /kvgate/inflight with values the
test sets (a stand-in for vLLM, not for a kvgate component); KV events come from a real ZMQ PUB socket
in vLLM's wire format. One test runs the agent against the real emulated worker (bench/emulator).
Heartbeats are 100 ms; every wait polls, nothing sleeps a fixed time; every process is stopped.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import msgpack
import pytest
import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from aiohttp import web

from bench.stack import stop_process
from policy.prefix import token_block_hashes
from store import index_store, registry
from store.redis_server import free_port
from store.registry import WorkerRecord
from tests.polling import until

pytestmark = pytest.mark.e2e

MODEL = "stand-in-model"
WAIT_S = 15.0


@dataclass
class FakeVllm:
    """The state the stand-in worker reports; tests change it between polls."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.1
    num_gpu_blocks: int = 500
    prompt_tokens: float = 100.0
    inflight: list[str] = field(default_factory=list)
    healthy: bool = True

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{MODEL}"'
        return "\n".join(
            [
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{labels}}} {self.running}",
                f"vllm:num_requests_waiting{{{labels}}} {self.waiting}",
                f"vllm:kv_cache_usage_perc{{{labels}}} {self.kv_usage}",
                f"vllm:prompt_tokens_total{{{labels}}} {self.prompt_tokens}",
                f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0',
                "",
            ]
        )


def stand_in_app(state: FakeVllm) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if state.healthy else 503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=state.metrics(), content_type="text/plain")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def inflight(_: web.Request) -> web.Response:
        return web.json_response({"request_ids": state.inflight})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/kvgate/inflight", inflight)
    return app


@asynccontextmanager
async def serve(app: web.Application, port: int) -> AsyncIterator[None]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield
    finally:
        await runner.cleanup()


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start `kvgate ...` subprocesses; every one is stopped at teardown."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plugin.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_process(proc, 5)
        if proc.stdout:
            proc.stdout.close()


def agent_args(redis_url: str, worker_port: int, *extra: str, model: str | None = MODEL) -> list[str]:
    return [
        "agent",
        "--worker-url", f"http://127.0.0.1:{worker_port}",
        *(["--model", model] if model else []),
        "--worker-id", "w1",
        "--redis", redis_url,
        "--heartbeat-ms", "100",
        "--lease-periods", "4",
        "--fail-periods", "2",
        "--http-timeout-s", "1",
        *extra,
    ]  # fmt: skip


async def worker(redis: aioredis.Redis) -> WorkerRecord | None:
    return await registry.read_worker(redis, MODEL, "w1", now_ms())


async def wait_process(proc: subprocess.Popen[str], timeout_s: float = WAIT_S) -> int:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if proc.poll() is None:
        raise AssertionError(f"{proc.args} still running after {timeout_s} s")
    return proc.returncode


async def test_registers_renews_reports_load_and_expires_when_worker_stops(
    redis: aioredis.Redis, redis_url: str, processes: Callable[..., subprocess.Popen[str]]
) -> None:
    state = FakeVllm(running=3, waiting=1, inflight=["r1", "r2"])
    port, agent_port = free_port(), free_port()
    async with serve(stand_in_app(state), port):
        agent = processes(*agent_args(redis_url, port, "--port", str(agent_port), "--max-concurrency", "8"))

        async def registered() -> bool:
            return (w := await worker(redis)) is not None and w.running == 3

        await until(registered, "registration", timeout_s=WAIT_S)
        first = await worker(redis)
        assert first is not None
        assert (first.url, first.max_concurrency, first.capacity_tokens, first.block_size) == (
            f"http://127.0.0.1:{port}",
            8,
            500 * 16,
            16,
        )
        assert (first.waiting, first.kv_usage, first.inflight_ids, first.live) == (1, 0.1, ("r1", "r2"), True)

        state.running, state.inflight = 0, []

        async def renewed_with_new_load() -> bool:
            w = await worker(redis)
            return w is not None and w.running == 0 and w.lease_expiry_ms > first.lease_expiry_ms + 100

        await until(renewed_with_new_load, "a heartbeat with the new load", timeout_s=WAIT_S)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{agent_port}/healthz") as resp:
                assert resp.status == 200
                assert (await resp.json())["registered"] is True
            async with session.get(f"http://127.0.0.1:{agent_port}/metrics") as resp:
                text = await resp.text()
        assert "kvgate_agent_heartbeats_total" in text
        assert 'kvgate_agent_lease_renewing{worker="w1"} 1' in text
    # the worker is gone: the agent stops renewing and the lease runs out

    async def expired() -> bool:
        w = await worker(redis)
        return w is not None and not w.live

    await until(expired, "lease expiry after the worker stopped", timeout_s=WAIT_S)
    stale = await worker(redis)
    assert stale is not None
    # the worker comes back on the same port: a restart, so a new epoch and a live lease again
    async with serve(stand_in_app(FakeVllm()), port):

        async def back() -> bool:
            w = await worker(redis)
            return w is not None and w.live and w.epoch > stale.epoch

        await until(back, "re-registration with a new epoch", timeout_s=WAIT_S)
        # a stopped agent takes its worker out of the pool at once
        agent.send_signal(signal.SIGTERM)
        assert await wait_process(agent) == 0
        assert await worker(redis) is None


async def test_drain_waits_for_in_flight_requests_then_agent_deregisters(
    redis: aioredis.Redis, redis_url: str, processes: Callable[..., subprocess.Popen[str]]
) -> None:
    state = FakeVllm(running=2, inflight=["a", "b"])
    port, agent_port = free_port(), free_port()
    async with serve(stand_in_app(state), port):
        # no --model: the agent registers under the models the worker lists in /v1/models
        agent = processes(*agent_args(redis_url, port, "--port", str(agent_port), model=None))

        async def registered() -> bool:
            return await worker(redis) is not None

        await until(registered, "registration under the model from /v1/models", timeout_s=WAIT_S)
        drain = processes(
            "drain", "w1", "--model", MODEL, "--redis", redis_url, "--wait", "--timeout-s", "20"
        )

        async def agent_sees_drain() -> bool:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{agent_port}/healthz") as resp,
            ):
                return bool((await resp.json())["draining"])

        await until(agent_sees_drain, "the agent to see the drain flag", timeout_s=WAIT_S)
        w = await worker(redis)
        assert w is not None and w.draining and w.live
        assert drain.poll() is None and agent.poll() is None, (
            "nothing may finish while requests are in flight"
        )

        state.running, state.inflight = 0, []
        assert await wait_process(drain) == 0
        assert await wait_process(agent) == 0
    assert drain.stdout is not None
    output = drain.stdout.read()
    assert "in flight 2" in output and "deregistered" in output
    assert await worker(redis) is None
    assert await registry.list_models(redis) == []


async def test_drain_times_out_and_cancel_restores(redis: aioredis.Redis, redis_url: str) -> None:
    from plugin import drain

    async def run(*argv: str) -> int:
        return await drain.drain(drain.build_parser().parse_args([*argv, "--redis", redis_url]))

    await registry.register(
        redis, WorkerRecord(id="w1", model=MODEL, url="http://x:1", running=1), 60_000, now_ms()
    )
    assert await run("w1", "--wait", "--timeout-s", "0.3", "--poll-ms", "50") == 1
    assert (await worker(redis)).draining is True  # type: ignore[union-attr]
    assert await run("w1", "--cancel") == 0
    assert (await worker(redis)).draining is False  # type: ignore[union-attr]
    assert await run("nobody") == 2


def batch(*events: object) -> bytes:
    return msgpack.packb([time.time(), list(events), 0])


async def test_kv_events_reach_the_index_store(
    redis: aioredis.Redis, redis_url: str, processes: Callable[..., subprocess.Popen[str]]
) -> None:
    tokens = list(range(5000, 5048))  # 3 engine blocks of 16
    keys = token_block_hashes(tokens, model=MODEL, block_size=16)[0]
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    zmq_port = pub.bind_to_random_port("tcp://127.0.0.1")
    seq = 0

    async def publish(payload: bytes) -> None:
        nonlocal seq
        await pub.send_multipart([b"kv@w1@" + MODEL.encode(), seq.to_bytes(8, "big"), payload])
        seq += 1

    async def index() -> dict[str, list[int]]:
        return await index_store.load_snapshot(redis, MODEL)

    port = free_port()
    try:
        async with serve(stand_in_app(FakeVllm()), port):
            processes(*agent_args(redis_url, port, "--kv-events", f"tcp://127.0.0.1:{zmq_port}"))

            # a SUB socket misses what is published before it connects: repeat the root block until seen
            async def root_indexed() -> bool:
                await publish(batch(["BlockStored", [101], None, tokens[:16], 16, None, "GPU"]))
                return (await index()).get("w1") == [keys[0]]

            await until(root_indexed, "the first stored block in the index", timeout_s=WAIT_S)
            epoch = (await worker(redis)).epoch  # type: ignore[union-attr]

            # map encoding (vLLM >= 0.26): two child blocks continue the chain from engine block 101
            stored = {"type": "BlockStored", "block_hashes": [102, 103], "parent_block_hash": 101,
                      "token_ids": tokens[16:48], "block_size": 16, "medium": "GPU"}  # fmt: skip
            await publish(batch(stored))

            async def children_indexed() -> bool:
                return sorted((await index()).get("w1", [])) == sorted(keys)

            await until(children_indexed, "child blocks re-hashed with the router's chain", timeout_s=WAIT_S)
            await publish(batch(["BlockRemoved", [103], "GPU"]))

            async def removed() -> bool:
                return sorted((await index()).get("w1", [])) == sorted(keys[:2])

            await until(removed, "a removed block to leave the index", timeout_s=WAIT_S)
            await publish(batch(["AllBlocksCleared"]))

            async def cleared() -> bool:
                w = await worker(redis)
                return "w1" not in await index() and w is not None and w.epoch > epoch

            await until(cleared, "AllBlocksCleared to clear the index and bump the epoch", timeout_s=WAIT_S)
    finally:
        pub.close(linger=0)
        ctx.term()


async def test_agent_against_the_emulated_worker_indexes_its_kv_events(
    redis: aioredis.Redis, redis_url: str, processes: Callable[..., subprocess.Popen[str]]
) -> None:
    """The real emulated vLLM worker (bench/emulator) publishing KV events; the agent indexes a prompt."""
    from bench.emulator.server import EmulatorConfig, start_emulator

    zmq_port = free_port()
    config = EmulatorConfig(
        model=MODEL, time_scale=0.05, worker_id="w1", kv_events_endpoint=f"tcp://127.0.0.1:{zmq_port}"
    )
    runner, port = await start_emulator(config)
    try:
        processes(*agent_args(redis_url, port, "--kv-events", f"tcp://127.0.0.1:{zmq_port}"))

        async def registered() -> bool:
            w = await worker(redis)
            return w is not None and w.capacity_tokens > 0

        await until(registered, "registration with the emulator's capacity", timeout_s=WAIT_S)
        prompt = list(range(100, 164))  # 4 full blocks
        keys = set(token_block_hashes(prompt, model=MODEL, block_size=16)[0])
        async with aiohttp.ClientSession() as session:

            async def prompt_indexed() -> bool:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                return keys <= set((await index_store.load_snapshot(redis, MODEL)).get("w1", []))

            await until(prompt_indexed, "the prompt's blocks in the index", timeout_s=WAIT_S)

        # A heartbeat written while the last request ran still lists it; a later one must not.
        async def idle_reported() -> bool:
            w = await worker(redis)
            return w is not None and json.dumps(w.inflight_ids) == "[]"

        await until(idle_reported, "a heartbeat with nothing in flight", timeout_s=WAIT_S)
    finally:
        await runner.cleanup()
