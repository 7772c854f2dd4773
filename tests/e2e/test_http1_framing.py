"""A gateway refuses a chunked request body whose chunk is not terminated by CRLF (request smuggling).

h11 < 0.16 skips any two bytes after a chunk (CVE-2025-43859), so a front proxy that reads the
framing differently would let a second request ride inside the first. mitmproxy parses HTTP/1
bodies with h11's readers: this fails on mitmproxy 11.0.2 with the h11 it pins (<= 0.14), which is
why the Makefile installs h11 >= 0.16 into Python 3.11 venvs (docs/OPERATIONS.md).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.e2e.harness import Gateway, SseUpstream, chat, gateways

pytestmark = pytest.mark.e2e

MODEL = "m"


def chunked_request(body: bytes, terminator: bytes) -> bytes:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    return head + f"{len(body):x}\r\n".encode() + body + terminator + b"0\r\n\r\n"


async def status_of(port: int, raw: bytes) -> int | None:
    """The response's status, or None if the gateway closed the connection without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 20)
    finally:
        writer.close()
    return int(status_line.split()[1]) if status_line else None


@pytest.mark.parametrize(
    ("terminator", "status", "forwarded"),
    [
        pytest.param(b"\r\n", 200, 1, id="CRLF: forwarded"),
        # mitmproxy drops a client whose request body breaks the framing, without an answer
        pytest.param(b"XX", None, 0, id="two other bytes: dropped, never forwarded"),
    ],
)
async def test_chunk_terminator_is_checked(
    redis: aioredis.Redis,
    redis_url: str,
    tmp_path: Path,
    terminator: bytes,
    status: int | None,
    forwarded: int,
) -> None:
    upstream = await SseUpstream(MODEL).start()
    upstream.release.set()  # answer at once
    config = tmp_path / "kvgate.toml"
    config.write_text(f'[models."{MODEL}"]\ntotal = 4\n')
    gw = Gateway(redis_url, config, workers=[upstream.url], model=MODEL, log_dir=tmp_path)
    try:
        async with gateways(gw):
            body = json.dumps(chat(MODEL, "hi", stream=True)).encode()
            assert await status_of(gw.port, chunked_request(body, terminator)) == status
        assert len(upstream.seen) == forwarded
    finally:
        await upstream.close()
