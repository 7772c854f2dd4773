"""Gateway lifecycle end to end: SIGTERM drains live streams; the plain `mitmdump -s` entry works.

Needs: the embedded redis-server (tests/conftest.py), the .venv's `mitmdump`, free loopback ports.
The upstream is harness.SseUpstream in the test's loop; processes are always stopped.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from plugin.mirror import wall_ms
from store import registry
from store.redis_server import free_port
from store.registry import WorkerRecord
from tests.e2e.harness import REPO, Gateway, SseUpstream, chat, get, poll, post

pytestmark = pytest.mark.e2e

MODEL = "m"


async def test_sigterm_lets_live_streams_finish_and_refuses_new_ones(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    upstream = await SseUpstream(MODEL).start()
    gw = Gateway(redis_url, workers=[upstream.url], model=MODEL, log_dir=tmp_path)
    try:
        await gw.start()
        async with aiohttp.ClientSession() as session:
            live = await session.post(f"{gw.url}/v1/chat/completions", json=chat(MODEL, "live", stream=True))
            assert (await live.content.readline()).startswith(b"data: ")
            gw.terminate()  # SIGTERM while the stream is held open upstream

            async def refusing() -> bool:
                status, _, _ = await post(f"{gw.url}/v1/chat/completions", chat(MODEL, "late"), timeout_s=2)
                return status == 503

            await poll(refusing, 10, "new requests to be refused while draining")
            upstream.release.set()
            rest = await live.read()
            assert rest.rstrip().endswith(b"data: [DONE]")  # the live stream completed
        assert gw.proc is not None
        assert await asyncio.to_thread(gw.proc.wait, 15) == 0
    except BaseException:
        print(gw.output()[-4000:], file=sys.stderr)
        raise
    finally:
        gw.stop()
        await upstream.close()


async def test_plain_mitmdump_with_the_entry_script(
    redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    upstream = await SseUpstream(MODEL).start()
    upstream.release.set()
    await registry.register(redis, WorkerRecord(id="w", model=MODEL, url=upstream.url), 60_000, wall_ms())
    port = free_port()
    mitmdump = str(Path(sys.executable).with_name("mitmdump"))
    config = REPO / "examples" / "kvgate.toml"
    args = [mitmdump, "--mode", "reverse:http://127.0.0.1:1", "--listen-host", "127.0.0.1", "-p", str(port),
            "-s", str(REPO / "plugin" / "entry.py"), "--set", f"kvgate_config={config}",
            "--set", f"kvgate_redis_url={redis_url}", "--set", "connection_strategy=lazy",
            "--set", f"confdir={tmp_path / 'mitm'}"]  # fmt: skip
    log = tmp_path / "mitmdump.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:

        async def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"mitmdump exited: {log.read_text()}")
            try:
                return (await get(f"{url}/healthz", timeout_s=1))[0] == 200
            except (aiohttp.ClientError, OSError, TimeoutError):
                return False

        await poll(healthy, 30, "mitmdump -s plugin/entry.py", interval_s=0.05)
        status, headers, body = await post(f"{url}/v1/chat/completions", chat(MODEL, "hi", stream=True))
        assert status == 200 and headers["x-kvgate-worker"] == "w"
        assert body.rstrip().endswith(b"data: [DONE]")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        await upstream.close()
