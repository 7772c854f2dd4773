"""Slowloris bodies and idle connections are cut off at `limits.client_request_timeout_ms`
(plugin/client_deadline.py), without holding up anyone else; a request the gateway itself is slow
to answer is never cut."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.e2e.harness import Gateway, SseUpstream, chat, gateways, post

pytestmark = pytest.mark.e2e

MODEL = "m"
TIMEOUT_S = 1.5


async def closed_after(port: int, first: bytes, trickle: bytes = b"") -> float:
    """Seconds until the gateway closes a connection that sent `first`, then `trickle` one byte every
    0.2 s (a slowloris body); 30.0 if it never does."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def dribble() -> None:
        writer.write(first)
        for byte in trickle:
            await asyncio.sleep(0.2)
            writer.write(bytes([byte]))
            await writer.drain()

    sender = asyncio.ensure_future(dribble())
    try:
        data = await asyncio.wait_for(reader.read(), 30)
        assert data == b"", data  # closed without an answer
        return time.monotonic() - start
    except TimeoutError:
        return 30.0
    finally:
        sender.cancel()
        writer.close()


async def test_slow_clients_are_cut_off_and_block_no_one(
    redis: aioredis.Redis, redis_url: str, tmp_path: Path, upstream: SseUpstream
) -> None:
    upstream.release.set()  # answer at once
    config = tmp_path / "kvgate.toml"
    config.write_text(
        f'[models."{MODEL}"]\ntotal = 4\n\n[limits]\nclient_request_timeout_ms = {int(TIMEOUT_S * 1000)}\n'
    )
    gw = Gateway(redis_url, config, workers=[upstream.url], model=MODEL, log_dir=tmp_path)
    body = json.dumps(chat(MODEL, "hello there")).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    async with gateways(gw):
        slow = [closed_after(gw.port, b"") for _ in range(20)]  # idle: connect, send nothing
        slow += [closed_after(gw.port, head[:30]) for _ in range(5)]  # stop mid-headers
        slow += [closed_after(gw.port, head, trickle=body) for _ in range(10)]  # slowloris body
        slow_tasks = [asyncio.ensure_future(c) for c in slow]
        await asyncio.sleep(0.3)
        # meanwhile everyone else is served at once
        for _ in range(10):
            start = time.monotonic()
            status, _, _ = await post(f"{gw.url}/v1/chat/completions", chat(MODEL, "quick"))
            assert status == 200
            assert time.monotonic() - start < 1.0
        closed = await asyncio.gather(*slow_tasks)
        # cut at the deadline (the sweep runs once a second), not by mitmproxy's hour-long idle timeout;
        # the slowloris bodies kept sending a byte every 0.2 s and were cut all the same
        assert all(TIMEOUT_S - 0.1 <= t <= TIMEOUT_S + 2.5 for t in closed), closed
        assert "sent no complete request within" in gw.output()


async def test_a_slow_or_queued_answer_is_not_cut_off(
    redis: aioredis.Redis, redis_url: str, tmp_path: Path
) -> None:
    held = await SseUpstream(MODEL).start()  # first event at once, the rest when released
    config = tmp_path / "kvgate.toml"
    config.write_text(
        f'[models."{MODEL}"]\ntotal = 1\n\n[admission]\nmax_wait_ms = 20000\n\n'
        "[limits]\nclient_request_timeout_ms = 500\n"
    )
    gw = Gateway(redis_url, config, workers=[held.url], model=MODEL, log_dir=tmp_path)
    try:
        async with gateways(gw):

            async def release_later() -> None:
                await asyncio.sleep(2.5)  # five deadlines: the wait is the gateway's, not the client's
                held.release.set()

            releaser = asyncio.ensure_future(release_later())
            url = f"{gw.url}/v1/chat/completions"
            # the second queues behind the first (total = 1) for 2.5 s: it is not cut off either
            answers = await asyncio.gather(
                *(post(url, chat(MODEL, f"hi {i}", stream=True), timeout_s=20) for i in range(2))
            )
            await releaser
            for status, _, text in answers:
                assert status == 200 and b"[DONE]" in text, text
    finally:
        await held.close()
