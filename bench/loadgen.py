"""Open-loop load generator for live runs: replays chat requests at fixed send times over real HTTP.

Each request is sent at its scheduled time whatever happened to earlier ones (open loop: a slow
server cannot slow the arrivals down), streamed, and measured from the client side: time to first
token (first SSE chunk that carries content), end-to-end latency, status, and the `usage` the
server reports (cached tokens). Used by `kvgate demo` and the live benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.stats import nearest_rank_percentile


@dataclass(frozen=True, slots=True)
class LiveRequest:
    send_at_s: float  # offset from the start of the run
    body: Mapping[str, object]  # OpenAI chat/completions body; "stream" is forced on
    headers: Mapping[str, str] = field(default_factory=dict)
    path: str = "/v1/chat/completions"


@dataclass(slots=True)
class LiveResult:
    index: int
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None


async def run_open_loop(
    base_url: str, requests: Sequence[LiveRequest], *, timeout_s: float = 300.0, max_connections: int = 512
) -> list[LiveResult]:
    """Send every request at its `send_at_s`, concurrently; return one result per request, in order."""
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as session:
        start = time.perf_counter()

        async def one(index: int, req: LiveRequest) -> LiveResult:
            delay = start + req.send_at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await send_streaming(session, index, req)

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))


async def send_streaming(session: aiohttp.ClientSession, index: int, req: LiveRequest) -> LiveResult:
    """POST one streaming request and meter it from the client side."""
    result = LiveResult(index=index)
    body = dict(req.body, stream=True, stream_options={"include_usage": True})
    sent = time.perf_counter()
    try:
        async with session.post(req.path, json=body, headers=dict(req.headers)) as resp:
            result.status = resp.status
            result.worker = resp.headers.get("x-kvgate-worker")
            if resp.status != 200:
                result.error = (await resp.text())[:500]
                return result
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    _meter_sse_line(line.strip(), result, sent)
            _meter_sse_line(buffer.strip(), result, sent)
            result.e2e_s = time.perf_counter() - sent
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _meter_sse_line(line: bytes, result: LiveResult, sent: float) -> None:
    if not line.startswith(b"data:"):
        return
    payload = line[5:].strip()
    if payload == b"[DONE]" or not payload:
        return
    try:
        event = json.loads(payload)
    except ValueError:
        return
    for choice in event.get("choices") or ():
        text = (choice.get("delta") or {}).get("content") or choice.get("text")
        if text:
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - sent
            result.output_tokens += 1
    if usage := event.get("usage"):
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.output_tokens = int(usage.get("completion_tokens") or result.output_tokens)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens") or 0)


percentile = nearest_rank_percentile  # the live benchmarks report nearest-rank percentiles (bench/stats.py)
