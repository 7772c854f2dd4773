"""The emulated vLLM worker end to end: a real server on a loopback port, real HTTP, a real ZMQ SUB.

Needs: nothing beyond the venv (no Redis). Each test starts its own server (time scale 0.05: the
modelled GPU runs 20x faster) and stops it; waits poll the server, never sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from bench.emulator.metrics import parse_prometheus_text, sample_value
from bench.emulator.server import EmulatorConfig, start_emulator
from bench.emulator.tokenizer import full_block_keys, render_chat, tokenize
from store.redis_server import free_port
from tests.polling import until

pytestmark = pytest.mark.e2e

MODEL = "emu-model"
CONFIG = EmulatorConfig(model=MODEL, time_scale=0.05, worker_id="w1")
TIMEOUT = aiohttp.ClientTimeout(total=30)


@asynccontextmanager
async def emulator(config: EmulatorConfig = CONFIG) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    runner, port = await start_emulator(config)
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            yield f"http://127.0.0.1:{port}", session
    finally:
        await runner.cleanup()


def chat(text: str, max_tokens: int = 8, stream: bool = False, **extra: object) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        **extra,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def metrics(session: aiohttp.ClientSession, url: str) -> list:
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return parse_prometheus_text(await resp.text())


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    return sample_value(await metrics(session, url), name, model_name=MODEL)


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict | str]:
    """Parsed `data:` payloads of an SSE response, as they arrive ("[DONE]" as a string)."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, list]:
    """(seconds to the first content chunk, all events)."""
    started = time.perf_counter()
    first = None
    events = []
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for event in sse_events(resp):
            if first is None and isinstance(event, dict) and event["choices"]:
                first = time.perf_counter() - started
            events.append(event)
    assert first is not None
    return first, events


async def test_stream_delivers_tokens_while_the_request_is_still_running() -> None:
    async with emulator() as (url, session):
        body = chat("stream please", max_tokens=1500, stream=True)
        contents: list[str] = []
        seen_running = False
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            async for event in sse_events(resp):
                if isinstance(event, dict) and event["choices"]:
                    contents.append(event["choices"][0]["delta"].get("content", ""))
                    if len(contents) == 3:  # tokens arrived while the engine still runs the request
                        seen_running = await metric(session, url, "vllm:num_requests_running") == 1
                last = event
        assert seen_running
        assert last == "[DONE]"
        assert len(contents) == 1 + 1500  # the role chunk, then one chunk per token


async def test_stream_chunks_and_usage() -> None:
    async with emulator() as (url, session):
        _, events = await stream_chat(session, url, chat("hello there", max_tokens=5, stream=True))
        assert events[-1] == "[DONE]"
        usage_chunk = events[-2]
        prompt_tokens = len(tokenize(render_chat([{"role": "user", "content": "hello there"}])))
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"] == {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + 5,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        chunks = events[:-2]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None] * 4 + ["length"]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


async def test_ttft_grows_with_prompt_length_and_falls_when_the_prefix_is_cached() -> None:
    # modelled prefill: ~32k tokens ≈ 1.3 s on the 8B/H100 profile (0.26 s at scale 0.2); 16 tokens ≈ 1 ms
    config = replace(CONFIG, time_scale=0.2)
    long_text = "The quick brown fox jumps over the lazy dog. " * 2800  # ~31.5k tokens
    async with emulator(config) as (url, session):
        short_ttft, _ = await stream_chat(session, url, chat("hi", max_tokens=2, stream=True))
        cold_ttft, cold = await stream_chat(session, url, chat(long_text, max_tokens=2, stream=True))
        warm_ttft, warm = await stream_chat(session, url, chat(long_text, max_tokens=2, stream=True))
    assert cold[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm[-2]["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt_tokens = warm[-2]["usage"]["prompt_tokens"]
    assert prompt_tokens - 16 < cached <= prompt_tokens  # all full blocks hit
    assert cached % 16 == 0
    assert cold_ttft > short_ttft + 0.1
    assert warm_ttft < cold_ttft - 0.1


async def test_non_stream_response_has_usage_and_cached_tokens_on_repeat() -> None:
    async with emulator() as (url, session):
        bodies = []
        for i in range(2):
            body = {"prompt": "x" * 400, "max_tokens": 3}
            headers = {"X-Request-Id": f"req-{i}"}
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                assert resp.headers["X-Request-Id"] == f"req-{i}"
                bodies.append(await resp.json())
        first, second = bodies
        assert first["object"] == "text_completion"
        assert first["id"] == "cmpl-req-0"  # vLLM's "<prefix>-<request id>"
        assert first["usage"] == {
            "prompt_tokens": 100,
            "total_tokens": 103,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 full blocks of 16
        assert first["choices"][0]["finish_reason"] == "length"


async def test_metrics_counters_move_and_max_concurrency_is_a_high_water_mark() -> None:
    async with emulator() as (url, session):
        before = await metrics(session, url)
        assert sample_value(before, "kvgate_emulator_requests_total") == 0

        async def one(i: int) -> None:
            async with session.post(
                f"{url}/v1/completions", json={"prompt": f"{i:04d}" * 100, "max_tokens": 1000}
            ):
                pass

        await asyncio.gather(*(one(i) for i in range(5)))
        await one(0)  # a repeat: its full blocks hit
        after = await metrics(session, url)
        assert sample_value(after, "kvgate_emulator_requests_total", model_name=MODEL) == 6
        assert sample_value(after, "kvgate_emulator_max_concurrent_requests", model_name=MODEL) == 5
        assert sample_value(after, "vllm:prompt_tokens_total", model_name=MODEL) == 600
        assert sample_value(after, "vllm:generation_tokens_total", model_name=MODEL) == 6000
        assert sample_value(after, "vllm:prefix_cache_queries_total", model_name=MODEL) >= 600
        assert sample_value(after, "vllm:prefix_cache_hits_total", model_name=MODEL) >= 96
        assert sample_value(after, "vllm:time_to_first_token_seconds_count", model_name=MODEL) == 6
        assert sample_value(after, "vllm:e2e_request_latency_seconds_count", model_name=MODEL) == 6
        assert sample_value(after, "vllm:num_requests_running", model_name=MODEL) == 0
        assert sample_value(after, "vllm:kv_cache_usage_perc", model_name=MODEL) >= 0
        assert sample_value(after, "vllm:cache_config_info", block_size="16") == 1


@pytest.mark.parametrize(
    ("prompt", "read_first_chunk"),
    [
        pytest.param("short prompt", True, id="disconnect while decoding"),
        pytest.param("a long prompt " * 30_000, False, id="disconnect during prefill"),
    ],
)
async def test_client_disconnect_aborts_the_request(prompt: str, read_first_chunk: bool) -> None:
    async with emulator() as (url, session):
        body = chat(prompt, max_tokens=20_000, stream=True)
        headers = {"X-Request-Id": "req-disconnect"}
        resp = await session.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 200

        async def held() -> bool:
            async with session.get(f"{url}/kvgate/inflight") as r:
                return (await r.json())["request_ids"] == ["req-disconnect"]

        await until(held, "a seat held", timeout_s=10.0)
        if read_first_chunk:
            await resp.content.readline()
            assert await metric(session, url, "vllm:num_requests_running") == 1
        resp.close()  # drops the connection

        async def freed() -> bool:
            async with session.get(f"{url}/kvgate/inflight") as r:
                ids = (await r.json())["request_ids"]
            samples = await metrics(session, url)
            busy = sample_value(samples, "vllm:num_requests_running") + sample_value(
                samples, "vllm:num_requests_waiting"
            )
            return ids == [] and busy == 0

        await until(freed, "the seat freed", timeout_s=10.0)
        # the worker still serves
        async with session.post(f"{url}/v1/chat/completions", json=chat("after", max_tokens=2)) as ok:
            assert ok.status == 200


@pytest.mark.parametrize(
    ("path", "data", "status", "error_type"),
    [
        pytest.param("/v1/chat/completions", b"{not json", 400, "BadRequestError", id="bad json"),
        pytest.param("/v1/completions", b"\xff\xfe", 400, "BadRequestError", id="not utf-8"),
        pytest.param("/v1/chat/completions", json.dumps({"model": "other", "messages": []}).encode(), 404,
                     "NotFoundError", id="unknown model"),
        pytest.param("/v1/chat/completions", json.dumps(chat("x", max_tokens="many")).encode(), 400,
                     "BadRequestError", id="max_tokens wrong type"),
        pytest.param("/v1/completions", json.dumps({"prompt": 42}).encode(), 400, "BadRequestError",
                     id="prompt wrong type"),
        pytest.param("/tokenize", b"[]", 400, "BadRequestError", id="tokenize a list"),
    ],
)  # fmt: skip
async def test_malformed_requests_get_openai_errors_and_disturb_nothing(
    path: str, data: bytes, status: int, error_type: str
) -> None:
    async with emulator() as (url, session):
        async with session.post(
            f"{url}{path}", data=data, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == status
            error = (await resp.json())["error"]
            assert error["type"] == error_type
            assert error["code"] == status
            assert error["message"]
        assert await metric(session, url, "kvgate_emulator_requests_total") == 0
        async with session.post(f"{url}/v1/chat/completions", json=chat("fine")) as ok:
            assert ok.status == 200


async def test_models_health_tokenize_and_unknown_paths() -> None:
    config = replace(CONFIG, extra_model_names=("alias",))
    async with emulator(config) as (url, session):
        async with session.get(f"{url}/health") as resp:
            assert resp.status == 200
        async with session.get(f"{url}/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == [MODEL, "alias"]
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        async with session.post(f"{url}/tokenize", json={"messages": messages}) as resp:
            body = await resp.json()
            assert body["tokens"] == tokenize(render_chat(messages))
            assert body["count"] == len(body["tokens"])
            assert body["max_model_len"] == CONFIG.max_model_len  # the 8B pool holds 436k tokens
        # vLLM's render endpoints (vllm-router and llm-d tokenize through them): the engine's own tokens
        async with session.post(f"{url}/v1/chat/completions/render", json={"messages": messages}) as resp:
            assert (await resp.json())["token_ids"] == tokenize(render_chat(messages))
        async with session.post(f"{url}/v1/completions/render", json={"prompt": ["abcdefgh", "ab"]}) as resp:
            assert [p["token_ids"] for p in await resp.json()] == [tokenize("abcdefgh"), tokenize("ab")]
        async with session.post(f"{url}/v1/chat/completions/render", json={"messages": []}) as resp:
            assert resp.status == 400
        async with session.post(f"{url}/v1/chat/completions", json={**chat("x"), "model": "alias"}) as resp:
            assert resp.status == 200
        async with session.get(f"{url}/nope") as resp:
            assert resp.status == 404
            assert await resp.json() == {"detail": "Not Found"}


async def test_kv_events_arrive_in_vllm_format_and_decode() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = replace(CONFIG, kv_events_endpoint=endpoint)
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    try:
        async with emulator(config) as (url, session):
            sub.connect(endpoint)

            async def clear_and_receive() -> list[bytes] | None:
                async with session.post(f"{url}/reset_prefix_cache") as resp:
                    assert resp.status == 200
                if await sub.poll(timeout=100):
                    return await sub.recv_multipart()
                return None

            # a SUB joins asynchronously: clear the cache (AllBlocksCleared) until one arrives
            deadline = time.monotonic() + 10
            while (first := await clear_and_receive()) is None:
                assert time.monotonic() < deadline
            topic, seq, payload = first
            assert topic == f"kv@w1@{MODEL}".encode()
            assert len(seq) == 8
            ts, events, dp_rank = msgpack.unpackb(payload)
            assert events == [["AllBlocksCleared"]]
            assert dp_rank == 0 and ts > 0
            while await sub.poll(timeout=50):  # drain the other clears
                last_seq = (await sub.recv_multipart())[1]
                assert int.from_bytes(last_seq, "big") > int.from_bytes(seq, "big")

            text = "tell me about KV caches " * 10
            async with session.post(f"{url}/v1/chat/completions", json=chat(text, max_tokens=2)) as resp:
                assert resp.status == 200
            tokens = tokenize(render_chat([{"role": "user", "content": text}]))
            keys = full_block_keys(tokens, 16)
            stored = []
            while sum(len(e[1]) for e in stored) < len(keys):
                assert await sub.poll(timeout=5000), "no BlockStored event"
                _, _, payload = await sub.recv_multipart()
                stored += [e for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"]
            assert stored[0][1:5] == [keys, None, tokens[: len(keys) * 16], 16]
            assert stored[0][6] == "GPU"
    finally:
        sub.close()
        context.term()


def test_cli_serves_until_sigterm() -> None:
    port = free_port()
    command = [sys.executable, "-m", "plugin.cli", "worker", "--port", str(port), "--model", MODEL,
               "--time-scale", "0.05", "--worker-id", "cli"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert f"http://127.0.0.1:{port}" in line
        body = json.dumps(chat("cli", max_tokens=2)).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_shrunk_kv_pool_caps_max_model_len() -> None:
    async with emulator(replace(CONFIG, num_gpu_blocks=100)) as (url, session):  # 1,600 tokens
        async with session.get(f"{url}/v1/models") as resp:
            assert (await resp.json())["data"][0]["max_model_len"] == 1600
        async with session.post(
            f"{url}/v1/completions", json={"prompt": "x" * 6000, "max_tokens": 200}
        ) as resp:
            assert resp.status == 400
            assert "maximum context length is 1600" in (await resp.json())["error"]["message"]
        samples = await metrics(session, url)
        assert sample_value(samples, "vllm:cache_config_info") == 1
        assert [s.labels["num_gpu_blocks"] for s in samples if s.name == "vllm:cache_config_info"] == ["100"]
