"""`kvgate proxy --processes 2` end to end: two processes serve one port (SO_REUSEPORT), share a
quota through Redis, a killed one is restarted, and SIGTERM stops them all with exit code 0.

Needs: the embedded redis-server (tests/conftest.py), free loopback ports. The upstream is
harness.SseUpstream in the test's loop, which holds a stream open until the test releases it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.e2e.harness import Gateway, SseUpstream, chat, gateways, poll

pytestmark = pytest.mark.e2e

MODEL = "m"


@dataclass
class Supervised(Gateway):
    processes: int = 2

    def command(self) -> list[str]:
        return [*super().command(), "--processes", str(self.processes)]


def children(parent: int) -> dict[str, int]:
    """gateway id -> pid of the live `kvgate proxy` children of `parent` (Linux /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and "--gateway-id" in argv:
            out[argv[argv.index("--gateway-id") + 1]] = int(entry)
    return out


async def session_per_process(url: str, want: int, tries: int = 60) -> dict[str, aiohttp.ClientSession]:
    """One keep-alive connection to each of `want` processes (the kernel spreads connections)."""
    found: dict[str, aiohttp.ClientSession] = {}
    for _ in range(tries):
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with session.get(f"{url}/readyz") as resp:  # its body names the process
            gateway = (await resp.json(content_type=None)).get("gateway")  # None: not up yet
        if gateway is None or gateway in found:
            await session.close()
        else:
            found[gateway] = session
        if len(found) == want:
            return found
    for session in found.values():
        await session.close()
    raise AssertionError(f"only {sorted(found)} answered on {url} after {tries} connections")


async def sessions_once_all_serve(url: str, want: int, timeout_s: float) -> dict[str, aiohttp.ClientSession]:
    """`session_per_process`, retried until every process listens (they start at their own pace)."""
    found: dict[str, aiohttp.ClientSession] = {}

    async def all_serve() -> bool:
        try:
            found.update(await session_per_process(url, want, tries=20))
        except AssertionError:
            return False
        return True

    await poll(all_serve, timeout_s, f"{want} processes to serve on {url}", interval_s=0.2)
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT balancing and /proc are Linux's")
async def test_two_processes_share_a_port_and_a_quota_and_one_killed_comes_back(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    upstream = await SseUpstream(MODEL).start()
    config = tmp_path / "kvgate.toml"
    config.write_text(f'[models."{MODEL}"]\ntotal = 1\n\n[routing]\nrefresh_ms = 100\n')
    gw = Supervised(
        redis_url, config, workers=[upstream.url], model=MODEL, gateway_id="sup", log_dir=tmp_path
    )
    try:
        async with gateways(gw):
            assert gw.proc is not None
            sessions = await sessions_once_all_serve(gw.url, 2, 30)
            assert sorted(sessions) == ["sup-p0", "sup-p1"]
            first, second = sessions["sup-p0"], sessions["sup-p1"]
            live = await first.post(f"{gw.url}/v1/chat/completions", json=chat(MODEL, "hold", stream=True))
            assert (await live.content.readline()).startswith(b"data: ")  # p0 holds the only slot
            async with second.post(f"{gw.url}/v1/chat/completions", json=chat(MODEL, "other"),
                                   headers={"x-kvgate-max-wait-ms": "0"}) as resp:  # fmt: skip
                assert resp.status == 429, await resp.text()  # p1 sees p0's slot in Redis
            upstream.release.set()
            assert (await live.read()).rstrip().endswith(b"data: [DONE]")
            live.release()
            for session in sessions.values():
                await session.close()

            before = children(gw.proc.pid)
            assert sorted(before) == ["sup-p0", "sup-p1"]
            os.kill(before["sup-p1"], signal.SIGKILL)

            async def restarted() -> bool:
                now = children(gw.proc.pid)  # type: ignore[union-attr]
                return now.get("sup-p1", before["sup-p1"]) != before["sup-p1"]

            await poll(restarted, 10, "the killed process to be started again")
            for session in (await sessions_once_all_serve(gw.url, 2, 30)).values():  # it serves again
                await session.close()
            async with aiohttp.ClientSession() as session:
                body = chat(MODEL, "after", stream=True)
                async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
            gw.terminate()
            assert await asyncio.to_thread(gw.proc.wait, 20) == 0
            assert children(gw.proc.pid) == {}
    finally:
        await upstream.close()
