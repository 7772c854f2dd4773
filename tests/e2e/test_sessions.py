"""Session affinity and the live ledger end to end: real mitmdump, real redis-server, two upstreams.

A session binds to its worker in Redis (with a TTL), later turns with unrelated text follow it (the
credit decides), and when that worker stalls (first tokens overdue: policy.ledger fed by the gateway's
request lifecycle) the hold limit withdraws the preference and the session moves. The client closes
the session with its last turn; a bad session id is a 400.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from plugin.decision_log import read_recent
from plugin.static_workers import static_worker_id
from store.sessions import session_key
from tests.e2e.harness import Gateway, SseUpstream, chat, gateways, get, metric, poll, post

pytestmark = pytest.mark.e2e

MODEL = "m"


class StallingUpstream(SseUpstream):
    """SseUpstream that, while `stalled`, holds each request before its first byte until `go` is set;
    `arrived` counts requests as they arrive (before any stall)."""

    def __init__(self, model: str) -> None:
        super().__init__(model, events=2)
        self.release.set()  # the stream itself never waits
        self.stalled = False
        self.go = asyncio.Event()
        self.arrived = 0

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.arrived += 1
        if self.stalled:
            await self.go.wait()
        return await super()._chat(request)


def turn(text: str, repeat: int = 600) -> dict[str, object]:
    return chat(
        MODEL, text * repeat, stream=True
    )  # thousands of prompt tokens, no prefix shared between texts


async def stream(
    gw: Gateway, text: str, session: str, repeat: int = 600, **extra: str
) -> tuple[int, dict[str, str]]:
    headers = {"content-type": "application/json", "x-kvgate-session-id": session, **extra}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client,
        client.post(
            f"{gw.url}/v1/chat/completions", data=json.dumps(turn(text, repeat)), headers=headers
        ) as resp,
    ):
        await resp.read()
        return resp.status, dict(resp.headers)


async def test_a_session_follows_its_worker_until_it_stalls_then_moves_and_closes(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    upstreams = [await StallingUpstream(MODEL).start() for _ in range(2)]
    config = tmp_path / "kvgate.toml"
    config.write_text(f'[models."{MODEL}"]\ntotal = 64\n\n[routing]\nrefresh_ms = 100\n')
    gw = Gateway(redis_url, config=config, workers=[u.url for u in upstreams], model=MODEL, log_dir=tmp_path)
    by_id = {static_worker_id(u.url): u for u in upstreams}
    key = session_key(MODEL, "conv-1")

    async def bound_to(worker: str) -> bool:
        return await redis.hget(key, "worker") == worker.encode()

    try:
        async with gateways(gw):
            status, headers = await stream(gw, "first turn ", "conv-1")
            assert status == 200 and headers["x-kvgate-session"] == "new"
            holder = headers["x-kvgate-worker"]
            other = next(w for w in by_id if w != holder)
            await poll(lambda: bound_to(holder), 5, "the session's binding in Redis")
            assert 0 < await redis.pttl(key) <= 600_000  # a binding always carries its TTL

            status, headers = await stream(gw, "unrelated second ", "conv-1")
            assert headers["x-kvgate-worker"] == holder  # no cached prefix anywhere: the session keeps it
            assert headers["x-kvgate-session"] in ("followed", "decided")

            stalled = by_id[holder]
            stalled.stalled = True  # the holder stops producing first tokens
            third = asyncio.ensure_future(stream(gw, "third, stalls ", "conv-1"))
            await poll(_async(lambda: stalled.arrived == 3), 5, "the third turn on the holder")
            # the third's prefill queued on the holder, on time: the session's credit still keeps it
            fourth = asyncio.ensure_future(stream(gw, "fourth, while the third is on time ", "conv-1"))
            await poll(_async(lambda: stalled.arrived == 4), 5, "the fourth turn on the holder")
            await asyncio.sleep(1.0)  # their first tokens are now ~1 s overdue (the ledger, live)
            # (twice as long: on time, the two queued turns would still leave the holder the cheaper)
            status, headers = await stream(gw, "fifth, after the stall ", "conv-1", repeat=1200)
            assert status == 200
            assert headers["x-kvgate-worker"] == other and headers["x-kvgate-session"] == "moved"
            await poll(lambda: bound_to(other), 5, "the binding moved to the other worker")
            stalled.go.set()
            assert (await third)[0] == 200 and (await fourth)[0] == 200

            status, _ = await stream(gw, "last ", "conv-1", **{"x-kvgate-session-close": "true"})
            assert status == 200

            async def closed() -> bool:
                return not await redis.exists(key)

            await poll(closed, 5, "the closed session's binding gone")
            _, body = await get(f"{gw.metrics_url}/metrics")
            text = body.decode()
            assert (metric(text, "kvgate_session_routes_total", model=MODEL, outcome="decided") or 0) >= 1
            assert metric(text, "kvgate_session_routes_total", model=MODEL, outcome="moved") == 1
            assert metric(text, "kvgate_sessions_closed_total", model=MODEL) == 1

            async def recorded() -> bool:  # the decision records name what the session did
                records = [r for r in await read_recent(redis, 50) if r.get("session")]
                return {r["session"]["outcome"] for r in records} >= {"new", "decided", "moved"}

            await poll(recorded, 5, "the decision records of the session's turns")

            bad, _, answer = await post(
                f"{gw.url}/v1/chat/completions", chat(MODEL, "x"), {"x-kvgate-session-id": "a b{c}"}
            )
            assert bad == 400 and json.loads(answer)["error"]["code"] == "invalid_session_id"
            bad, _, answer = await post(
                f"{gw.url}/v1/chat/completions", chat(MODEL, "x"),
                {"x-kvgate-session-id": "ok", "x-kvgate-session-close": "maybe"},
            )  # fmt: skip
            assert bad == 400 and json.loads(answer)["error"]["code"] == "invalid_session_close"
    finally:
        for u in upstreams:
            u.go.set()
            await u.close()


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def wrapped() -> bool:
        return check()

    return wrapped
