"""Shared helpers for end-to-end tests: real processes and servers on 127.0.0.1, always stopped.

- `Gateway`: `kvgate proxy` (mitmdump + the kvgate addon) as a subprocess, polled until /readyz
  answers, stopped with SIGTERM then SIGKILL; its output goes to a log file (a full pipe would block
  the proxy) that failing tests print.
- `start_worker`: an emulated vLLM worker (bench/emulator) in the test's loop, on a free port.
- `SseUpstream`: a tiny controllable OpenAI-style SSE server (for streaming tests that need to
  hold the upstream mid-stream).
- small HTTP helpers over aiohttp, and `metric()` to read one sample from Prometheus text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench.stack import stop_process
from store.redis_server import free_port
from tests.polling import until
from tests.prom import metric as metric

REPO = Path(__file__).resolve().parents[2]


async def poll(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: str, interval_s: float = 0.02
) -> None:
    """`tests.polling.until` with the argument order the e2e tests use."""
    await until(check, what, timeout_s, interval_s)


@dataclass
class Gateway:
    """One `kvgate proxy` process."""

    redis_url: str
    config: Path | None = None
    workers: Sequence[str] = ()
    model: str = ""
    worker_max_concurrency: int = 0
    gateway_id: str = "gw"
    log_dir: Path = Path("/tmp")
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def log(self) -> Path:
        return self.log_dir / f"gateway-{self.gateway_id}-{self.port}.log"

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "plugin.cli", "proxy", "--listen-port", str(self.port),
                "--redis", self.redis_url, "--gateway-id", self.gateway_id,
                "--metrics-port", str(self.metrics_port)]  # fmt: skip
        if self.config is not None:
            args += ["--config", str(self.config)]
        for url in self.workers:
            args += ["--worker", url]
        if self.model:
            args += ["--model", self.model]
        if self.worker_max_concurrency:
            args += ["--worker-max-concurrency", str(self.worker_max_concurrency)]
        return args

    async def start(self, timeout_s: float = 30.0, expect_healthy: bool = True) -> Gateway:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **self.env}
            )

        async def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status, _ = await get(f"{self.url}/readyz", timeout_s=1.0)
            except (TimeoutError, aiohttp.ClientError, OSError):
                return False
            return status == 200 or (not expect_healthy and status == 503)

        await poll(ready, timeout_s, f"gateway on port {self.port}", interval_s=0.05)
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s)


@contextlib.asynccontextmanager
async def gateways(*gws: Gateway) -> AsyncIterator[tuple[Gateway, ...]]:
    """Start gateways (in parallel) and always stop them; print their logs if the body fails."""
    try:
        await asyncio.gather(*(g.start() for g in gws))
        yield gws
    except BaseException:
        for g in gws:
            print(f"---- {g.log} ----\n{g.output()[-4000:]}", file=sys.stderr)
        raise
    finally:
        for g in gws:
            g.stop()


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` on a free loopback port in this loop; returns (runner, url). Clean up the runner."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def start_worker(model: str, worker_id: str, **config: Any) -> tuple[web.AppRunner, str]:
    """An emulated vLLM worker on a free port in this loop; returns (runner, url). Clean up the runner."""
    from bench.emulator.server import EmulatorConfig, start_emulator

    runner, port = await start_emulator(EmulatorConfig(model=model, worker_id=worker_id, **config))
    return runner, f"http://127.0.0.1:{port}"


# -- a controllable SSE upstream ------------------------------------------------------------------------


class SseUpstream:
    """OpenAI-style streaming chat server whose pace the test controls.

    Each request sends its first event at once, then waits for `release` before sending the rest;
    `sent_first` / `finished` count requests at each stage, `seen_headers` keeps request headers.
    """

    def __init__(self, model: str, events: int = 5) -> None:
        self.model = model
        self.events = events
        self.release = asyncio.Event()
        self.first_sent_at: list[float] = []
        self.finished_at: list[float] = []
        self.seen: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> SseUpstream:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner, self.url = await serve(app)
        return self

    async def close(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"headers": dict(request.headers), "body": body})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)

        def chunk(i: int) -> bytes:
            event = {"id": "x", "object": "chat.completion.chunk", "model": self.model,
                     "choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}  # fmt: skip
            return b"data: " + json.dumps(event).encode() + b"\n\n"

        await response.write(chunk(0))
        self.first_sent_at.append(time.monotonic())
        await self.release.wait()
        for i in range(1, self.events):
            await response.write(chunk(i))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": self.events,
                                              "prompt_tokens_details": {"cached_tokens": 4}}}  # fmt: skip
            await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self.finished_at.append(time.monotonic())
        return response


# -- HTTP helpers ---------------------------------------------------------------------------------------


async def get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
        session.get(url) as resp,
    ):
        return resp.status, await resp.read()


async def post(
    url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None, timeout_s: float = 30.0
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
        session.post(url, data=data, headers={"content-type": "application/json", **(headers or {})}) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.read()


def chat(
    model: str, text: str, *, stream: bool = False, max_tokens: int = 8, system: str = ""
) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return {"model": model, "messages": messages, "stream": stream, "max_tokens": max_tokens}
