"""Issue 10's failure list, each case with real processes and the fault injected for real.

Gateways are `kvgate proxy` subprocesses; Redis is a redis-server killed with SIGKILL, restarted on
the same port empty, or paused with SIGSTOP (tests/e2e/faults.py); upstreams are the controllable
SSE server (holds every stream after its first event until released) or emulated vLLM workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from bench.stack import stop_process
from runtime.tasks import spawn
from store import keys
from store.redis_server import free_port, stable_socket_path
from store.scripts import quota_key
from tests.e2e.faults import Answer, RedisProcess, alive, children_named, send
from tests.e2e.harness import Gateway, SseUpstream, chat, gateways, get, poll, serve, start_worker

pytestmark = pytest.mark.e2e

MODEL = "m"
CONFIG = f"""
[models."{MODEL}"]
total = 3

[routing]
refresh_ms = 100

[admission]
lease_ms = 4000
renew_every_ms = 1000
"""


@pytest.fixture
async def redis_proc() -> AsyncIterator[RedisProcess]:
    proc = RedisProcess().start()
    try:
        yield proc
    finally:
        proc.stop()


def config_file(tmp_path: Path, text: str = CONFIG) -> Path:
    path = tmp_path / "kvgate.toml"
    path.write_text(text)
    return path


def gateway(redis_url: str, up: SseUpstream, tmp_path: Path, **kw: object) -> Gateway:
    return Gateway(redis_url, config=config_file(tmp_path), workers=[up.url], model=MODEL, log_dir=tmp_path,
                   **kw)  # type: ignore[arg-type]  # fmt: skip


async def held_burst(gw: Gateway, up: SseUpstream, n: int, headers: dict[str, str] | None = None) -> int:
    """Send `n` streams at once; return how many reached the upstream while it held them all (the
    running count at the worker's own side), then release them and check every one was answered 200."""
    up.release = asyncio.Event()
    up.first_sent_at.clear()
    tasks = [
        spawn(send(gw.url, chat(MODEL, f"hi {i}", stream=True), headers), name=f"s{i}") for i in range(n)
    ]

    async def reached_or_answered() -> bool:
        return len(up.first_sent_at) >= 1 or all(t.done() for t in tasks)

    await poll(reached_or_answered, 20, "a stream at the upstream")
    await asyncio.sleep(1.0)  # a gate that lets more through would have by now
    running = len(up.first_sent_at)
    up.release.set()
    answers: list[Answer] = await asyncio.gather(*tasks)
    assert [a.status for a in answers] == [200] * n, [(a.status, a.body[:200], a.error) for a in answers]
    return running


async def quota_hash(url: str) -> dict[str, str]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        return await client.hgetall(quota_key(MODEL))  # type: ignore[no-any-return]
    finally:
        await client.aclose()


async def ready(gw: Gateway) -> bool:
    try:
        return (await get(f"{gw.url}/readyz", timeout_s=1.0))[0] == 200
    except (OSError, TimeoutError):
        return False


# -- 1. a Redis restart must not switch admission off -----------------------------------------------


async def test_quota_is_enforced_after_a_redis_restart(
    redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path
) -> None:
    gw = gateway(redis_proc.url, upstream, tmp_path)
    async with gateways(gw):
        assert await held_burst(gw, upstream, 8) == 3
        redis_proc.restart()  # SIGKILL, then an empty redis-server on the same port (no quota hash)
        await poll(lambda: ready(gw), 20, "the gateway ready again (static worker registered again)")
        assert await held_burst(gw, upstream, 8) == 3  # not 8: a missing quota never means unlimited
        stored = await quota_hash(redis_proc.url)
        assert (stored["total"], stored["origin"]) == ("3", "config")
        assert "was missing in Redis" in gw.output()


async def test_an_operator_change_survives_a_gateway_restart(
    redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path
) -> None:
    gw = gateway(redis_proc.url, upstream, tmp_path)
    async with gateways(gw):
        await poll(lambda: _quota_written(redis_proc.url), 10, "the configured quota")
        client = aioredis.Redis.from_url(redis_proc.url)
        await client.hset(quota_key(MODEL), "total", 5)  # an operator's run-time change
        await client.aclose()
    again = gateway(redis_proc.url, upstream, tmp_path)  # same config (total = 3), a fresh process
    async with gateways(again):
        assert await held_burst(again, upstream, 8) == 5
        stored = await quota_hash(redis_proc.url)
        assert (stored["total"], stored["origin"]) == ("5", "operator")


async def _quota_written(url: str) -> bool:
    return (await quota_hash(url)).get("total") == "3"


# -- 2. a reused x-request-id must not share a lease -----------------------------------------------


async def test_a_reused_request_id_does_not_bypass_the_quota(
    redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path
) -> None:
    gw = gateway(redis_proc.url, upstream, tmp_path)
    async with gateways(gw):
        assert await held_burst(gw, upstream, 8, headers={"x-request-id": "same-id"}) == 3
        forwarded = {v for s in upstream.seen for k, v in s["headers"].items() if k.lower() == "x-request-id"}
        assert len(forwarded) == 8 and all(f.startswith("same-id.") for f in forwarded)


# -- 4. Redis down: 503 + Retry-After, unready but alive, recovery by itself -------------------------


async def test_redis_killed_means_503_with_retry_after_then_recovery(
    redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path
) -> None:
    upstream.release.set()
    gw = gateway(redis_proc.url, upstream, tmp_path)
    async with gateways(gw):
        assert (await send(gw.url, chat(MODEL, "before"))).status == 200
        assert redis_proc.server is not None
        redis_proc.kill()
        answers = await asyncio.gather(*(send(gw.url, chat(MODEL, f"down {i}")) for i in range(20)))
        assert {a.status for a in answers} == {503}, [(a.status, a.body[:120]) for a in answers]
        assert all(int(a.headers["Retry-After"]) >= 1 for a in answers)
        assert {json.loads(a.body)["error"]["code"] for a in answers} <= {"redis_unavailable"}
        assert (await get(f"{gw.metrics_url}/healthz"))[0] == 200  # alive: no restart of every pod at once
        assert (await get(f"{gw.url}/readyz"))[0] == 503  # not ready
        redis_proc.start()
        await poll(lambda: ready(gw), 20, "the gateway ready again")
        assert (await send(gw.url, chat(MODEL, "after"))).status == 200
        assert "Traceback" not in gw.output()


async def test_a_redis_pause_longer_than_a_lease_is_not_a_fleet_death(
    redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path
) -> None:
    upstream.release.set()
    gw = gateway(redis_proc.url, upstream, tmp_path)
    async with gateways(gw):
        assert (await send(gw.url, chat(MODEL, "before"))).status == 200
        redis_proc.pause()  # SIGSTOP for longer than the static worker's 4 s lease
        try:
            during = await send(gw.url, chat(MODEL, "during"), timeout_s=8)  # bounded by redis_timeout_ms
            assert during.status == 503 and json.loads(during.body)["error"]["code"] == "redis_unavailable"
            await asyncio.sleep(5.0)
        finally:
            redis_proc.resume()
        after = await send(gw.url, chat(MODEL, "after"))
        assert after.status == 200, after.body[:300]  # not 503 no_healthy_worker


# -- 5. bad input gets a clear answer, never a 500, never forwarded raw ------------------------------


async def raw_status(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(65536), 20)
    finally:
        writer.close()
    status = int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else 0
    return status, response


def request_head(extra: bytes, length: int) -> bytes:
    start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    return start + extra + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % length


@pytest.mark.parametrize(
    ("header", "status"),
    [
        pytest.param(b"x-request-id: caf\xe9\r\n", 400, id="latin-1 request id"),
        pytest.param(b"x-request-id: " + b"a" * 100_000 + b"\r\n", None, id="100 KB request id"),
        pytest.param(b"x-request-id: abc\rSet-Cookie: evil=1\r\n", None, id="CR in request id"),
        pytest.param(b"x-request-id: abc\x00def\r\n", None, id="NUL in request id"),
        pytest.param(b"x-request-id: a b\r\n", 400, id="space in request id"),
        pytest.param("x-kvgate-priority: ١\r\n".encode(), 400, id="Arabic-Indic digit priority"),
        pytest.param(b"x-kvgate-priority: +5\r\n", 400, id="plus-signed priority"),
        pytest.param(b"x-kvgate-max-wait-ms: \xd9\xa1\r\n", 400, id="Arabic-Indic digit wait"),
    ],
)
async def test_bad_headers_are_refused_cleanly(
    redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path, header: bytes, status: int | None
) -> None:
    upstream.release.set()
    gw = gateway(redis_proc.url, upstream, tmp_path)
    body = json.dumps(chat(MODEL, "hi")).encode()
    async with gateways(gw):
        got, response = await raw_status(gw.port, request_head(header, len(body)), body)
        if status is None:  # refused by the gateway or by its HTTP parser, but refused
            assert 400 <= got < 500 or got == 0, response[:300]
        else:
            assert got == status, response[:300]
        assert b"evil" not in response and b"Set-Cookie" not in response
        assert upstream.seen == []  # never forwarded
        assert "Traceback" not in gw.output()


async def test_deeply_nested_json_is_a_400(
    redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path
) -> None:
    gw = gateway(redis_proc.url, upstream, tmp_path)
    async with gateways(gw):
        nested = json.dumps({**chat(MODEL, "x"), "tools": "HERE"}).encode()
        for body in (b"[" * 100_000, nested.replace(b'"HERE"', b"[" * 200 + b"]" * 200)):
            answer = await send(gw.url, body)
            assert answer.status == 400 and json.loads(answer.body)["error"]["code"] == "invalid_json"
        assert "Traceback" not in gw.output()


async def test_client_headers_are_not_forwarded_to_workers(
    redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path
) -> None:
    upstream.release.set()
    config = config_file(tmp_path, CONFIG + '\n[gateway]\nupstream_api_key = "env:TEST_UPSTREAM_KEY"\n')
    gw = Gateway(redis_proc.url, config=config, workers=[upstream.url], model=MODEL, log_dir=tmp_path,
                 env={"TEST_UPSTREAM_KEY": "worker-key"})  # fmt: skip
    headers = {"Authorization": "Bearer tenant-secret", "X-Forwarded-For": "6.6.6.6", "Forwarded": "for=x",
               "x-kvgate-worker": "spoofed", "x-kvgate-internal": "1", "Keep-Alive": "timeout=5",
               "Connection": "keep-alive, x-drop-me", "x-drop-me": "1", "x-custom": "kept"}  # fmt: skip
    async with gateways(gw):
        answer = await send(gw.url, chat(MODEL, "hi"), headers)
        assert answer.status == 200
    seen = {k.lower(): v for k, v in upstream.seen[0]["headers"].items()}
    assert seen["authorization"] == "Bearer worker-key"  # replaced, never the tenant's key
    assert seen["x-custom"] == "kept"
    for name in (
        "x-forwarded-for",
        "forwarded",
        "x-kvgate-worker",
        "x-kvgate-internal",
        "keep-alive",
        "x-drop-me",
    ):
        assert name not in seen, name
    assert "tenant-secret" not in json.dumps(upstream.seen)


# -- 3. the worker plane: signed registrations, a live id is not taken over ------------------------


def agent_command(worker_url: str, redis_url: str, worker_id: str) -> list[str]:
    return [sys.executable, "-m", "plugin.cli", "agent", "--worker-url", worker_url, "--model", MODEL,
            "--worker-id", worker_id, "--redis", redis_url, "--heartbeat-ms", "200"]  # fmt: skip


async def test_only_signed_workers_are_routable_and_a_live_id_is_not_taken_over(
    redis_proc: RedisProcess, tmp_path: Path
) -> None:
    runner_a, url_a = await start_worker(MODEL, "a")
    runner_b, url_b = await start_worker(MODEL, "b")
    secret = {"KVGATE_WORKER_SECRET": "s3cret"}
    gw = Gateway(redis_proc.url, config=config_file(tmp_path), log_dir=tmp_path, env=secret)
    procs: list[subprocess.Popen[bytes]] = []

    def agent(url: str, env: dict[str, str], name: str) -> Path:
        log = tmp_path / f"agent-{name}.log"
        with log.open("wb") as out:
            procs.append(subprocess.Popen(agent_command(url, redis_proc.url, "w1"), stdout=out,
                                          stderr=subprocess.STDOUT, env={**os.environ, **env}))  # fmt: skip
        return log

    try:
        await gw.start(expect_healthy=False)
        agent(url_a, {}, "unsigned")  # a stock agent without the secret
        await poll(lambda: _logged(gw, "not routable"), 20, "the gateway refusing the unsigned worker")
        refused = await send(gw.url, chat(MODEL, "hi"))
        assert refused.status in (404, 503) and refused.status != 200
        stop_process(procs.pop())
        client = aioredis.Redis.from_url(redis_proc.url)
        await client.delete(keys.worker(MODEL, "w1"), keys.workers(MODEL))  # its lease, gone at once
        await client.aclose()
        agent(url_a, secret, "signed")
        await poll(lambda: ready(gw), 20, "the signed worker routable")
        assert (await send(gw.url, chat(MODEL, "hi"))).status == 200
        other = agent(url_b, secret, "impostor")  # the same id with another URL, signed even
        await poll(lambda: _file_has(other, "registration refused"), 20, "the second agent refused")
        answers = [await send(gw.url, chat(MODEL, f"q{i}")) for i in range(5)]
        assert {a.status for a in answers} == {200}
        assert {a.headers["x-kvgate-worker"] for a in answers} == {"w1"}
        client = aioredis.Redis.from_url(redis_proc.url, decode_responses=True)
        assert await client.hget(keys.worker(MODEL, "w1"), "url") == url_a
        await client.aclose()
    finally:
        for proc in procs:
            stop_process(proc)
        gw.stop()
        await runner_a.cleanup()
        await runner_b.cleanup()


async def _logged(gw: Gateway, text: str) -> bool:
    return text in gw.output()


async def _file_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


# -- 4. the embedded Redis dies with its gateway, even after kill -9 -------------------------------


async def test_embedded_redis_dies_with_a_killed_gateway(upstream: SseUpstream, tmp_path: Path) -> None:
    gw = Gateway("", config=config_file(tmp_path), workers=[upstream.url], model=MODEL, log_dir=tmp_path,
                 gateway_id="solo")  # fmt: skip
    async with gateways(gw):
        assert gw.proc is not None
        servers = children_named(gw.proc.pid, "redis-server")
        assert len(servers) == 1
        assert stable_socket_path("solo") in gw.output()  # the address its agents are given
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait()

        async def gone() -> bool:
            return not alive(servers[0])

        await poll(gone, 10, "the embedded redis-server to die with its gateway")


# -- 5. an oversized body gets its 413 for every client, with no hang -------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_oversized_bodies_get_a_413_without_a_hang(
    redis_proc: RedisProcess, upstream: SseUpstream, tmp_path: Path, chunked: bool
) -> None:
    import httpx
    import openai

    config = config_file(tmp_path, CONFIG + "\n[limits]\nmax_body_bytes = 100000\n")
    gw = Gateway(redis_proc.url, config=config, workers=[upstream.url], model=MODEL, log_dir=tmp_path)
    big = "x" * 5_000_000  # over mitmproxy's body_size_limit (2 x max_body_bytes), no Expect header
    body = json.dumps(chat(MODEL, big)).encode()

    def with_httpx() -> int:
        content = iter([body[i : i + 65536] for i in range(0, len(body), 65536)]) if chunked else body
        with httpx.Client(timeout=20) as client:
            return client.post(f"{gw.url}/v1/chat/completions", content=content,
                               headers={"content-type": "application/json"}).status_code  # fmt: skip

    def with_openai_sdk() -> int:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", timeout=20, max_retries=0)
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}])
        except openai.APIStatusError as e:
            return e.status_code
        return 200

    async with gateways(gw):
        started = time.monotonic()
        assert await asyncio.to_thread(with_httpx) == 413
        if not chunked:  # the SDK always sends a length
            assert await asyncio.to_thread(with_openai_sdk) == 413
        assert time.monotonic() - started < 15  # not a client timeout
    assert upstream.seen == []


# -- 6. a worker that breaks off mid-stream: the stream ends with an SSE error event ----------------


async def test_a_stream_broken_by_its_worker_ends_with_an_sse_error_event(
    redis_proc: RedisProcess, tmp_path: Path
) -> None:
    from aiohttp import web

    async def chat_handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        event = {
            "id": "x",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "a"}}],
        }
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await asyncio.sleep(0.2)
        assert request.transport is not None
        request.transport.abort()  # the worker dies mid-stream
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response(text="ok"))  # type: ignore[arg-type, return-value]
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_handler)
    runner, worker_url = await serve(app)
    gw = Gateway(redis_proc.url, config=config_file(tmp_path), workers=[worker_url],
                 model=MODEL, log_dir=tmp_path)  # fmt: skip
    try:
        async with gateways(gw):
            answer = await send(gw.url, chat(MODEL, "hi", stream=True))
            assert answer.status == 200 and answer.error == "", answer.error  # a well-formed end
            last = [line for line in answer.body.split(b"\n") if line.startswith(b"data: ")][-1]
            assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == "upstream_stream_broken"
            client = aioredis.Redis.from_url(redis_proc.url)
            await poll(lambda: _no_leases(client), 10, "the lease released")
            await client.aclose()
    finally:
        await runner.cleanup()


async def _no_leases(client: aioredis.Redis) -> bool:
    return await client.zcard(keys.model_key(MODEL, "leases")) == 0


# -- 6b. a worker that refuses the connection: routed again before the first byte ------------------


async def test_a_refused_connection_is_routed_to_another_worker(
    redis_proc: RedisProcess, tmp_path: Path
) -> None:
    from store import registry
    from store.registry import WorkerRecord

    runner_a, url_a = await start_worker(MODEL, "a")
    runner_b, url_b = await start_worker(MODEL, "b")
    client = aioredis.Redis.from_url(redis_proc.url)
    now = int(time.time() * 1000)
    for wid, url in (("a", url_a), ("b", url_b)):  # the test is their agent: leases that outlive a
        await registry.register(client, WorkerRecord(id=wid, model=MODEL, url=url), 120_000, now)
    gw = Gateway(redis_proc.url, config=config_file(tmp_path), log_dir=tmp_path)
    try:
        async with gateways(gw):
            await runner_a.cleanup()  # worker a dies; its lease is still live in the registry
            answers = [await send(gw.url, chat(MODEL, f"question {i} " * 30)) for i in range(10)]
            assert [a.status for a in answers] == [200] * 10, [(a.status, a.body[:200]) for a in answers]
            assert {a.headers["x-kvgate-worker"] for a in answers} == {"b"}
            assert "refused the connection; routed to b" in gw.output()
    finally:
        await client.aclose()
        await runner_b.cleanup()


# -- rediss://: a gateway on a TLS-only redis-server with a self-signed certificate ----


async def test_a_gateway_over_rediss(upstream: SseUpstream, tmp_path: Path) -> None:
    from bench.redis7 import start_tls_only, tls_redis_server

    found = tls_redis_server()
    if found is None:
        pytest.skip("no TLS-capable redis-server: set KVGATE_TLS_REDIS_SERVER (needs apt-get otherwise)")
    binary, env = found
    port = free_port()
    server, cert = start_tls_only(binary, env, tmp_path, port)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    upstream.release.set()
    try:
        client = aioredis.Redis.from_url(url)
        await poll(lambda: _pings(client), 10, "the TLS redis-server")
        plain = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=1)
        with pytest.raises(Exception):  # noqa: B017  (a plaintext client is not served)
            await asyncio.wait_for(plain.ping(), 3)
        await plain.aclose()
        gw = gateway(url, upstream, tmp_path)
        async with gateways(gw):
            assert (await send(gw.url, chat(MODEL, "over tls"))).status == 200
            stored = await client.hgetall(quota_key(MODEL))
            assert stored[b"total"] == b"3"  # admission ran in the TLS Redis
        await client.aclose()
    finally:
        server.kill()
        server.wait()


async def _pings(client: aioredis.Redis) -> bool:
    try:
        return bool(await client.ping())
    except Exception:
        return False


# -- Sentinel: the gateway follows a new primary when the old one is killed ------------------------


async def test_the_gateway_follows_a_sentinel_failover(upstream: SseUpstream, tmp_path: Path) -> None:
    from bench.redis7 import tls_redis_server
    from bench.sentinel import SentinelSet

    found = tls_redis_server()  # Debian's redis-server 7 (it runs as redis-sentinel too)
    if found is None:
        pytest.skip("no redis-server 7 binary: set KVGATE_TLS_REDIS_SERVER (needs apt-get otherwise)")
    redis_set = SentinelSet(*found, tmp_path).start()  # primary + replica + sentinel, replica known
    upstream.release.set()
    try:
        gw = gateway(redis_set.url, upstream, tmp_path)
        async with gateways(gw):
            assert (await send(gw.url, chat(MODEL, "before"))).status == 200
            old = redis_set.primary_url
            await asyncio.get_running_loop().run_in_executor(None, redis_set.failover)  # kill, promote
            assert redis_set.primary_url != old
            await poll(lambda: ready(gw), 20, "the gateway ready on the new primary")
            after = await send(gw.url, chat(MODEL, "after"))
            assert after.status == 200, after.body[:300]
            primary = aioredis.Redis.from_url(redis_set.primary_url, decode_responses=True)
            assert (await primary.hgetall(quota_key(MODEL)))["total"] == "3"  # admission on the new one
            await primary.aclose()
    finally:
        redis_set.stop()
