"""The examples run as a user would run them: examples/staging.sh (plain `mitmdump -s plugin/entry.py`
in reverse mode) in front of two emulated vLLM workers, and examples/openai_client.py (the official
`openai` client, priority set once with `default_headers`) against it. Real processes, real Redis;
the gateway's decision records show the priority arrived and both workers were used."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from bench.stack import stop_process
from plugin.decision_log import read_recent
from store.redis_server import free_port
from tests.e2e.harness import REPO, chat, get, poll, post, start_worker

pytestmark = pytest.mark.e2e

MODEL = "staging-model"


async def test_staging_recipe_and_openai_client_example(
    tmp_path: Path, redis: aioredis.Redis, redis_url: str
) -> None:
    runners, urls = [], []
    for i in range(2):
        runner, url = await start_worker(MODEL, f"w{i}")
        runners.append(runner)
        urls.append(url)
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "WORKER_A": urls[0], "WORKER_B": urls[1], "PORT": str(port), "REDIS_URL": redis_url}  # fmt: skip
    log = tmp_path / "staging.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(REPO / "examples" / "staging.sh")], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    gateway = f"http://127.0.0.1:{port}"
    try:

        async def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return (await get(f"{gateway}/readyz", timeout_s=1.0))[0] == 200
            except OSError:
                return False

        await poll(healthy, 30, "examples/staging.sh to be ready", interval_s=0.1)
        # requests spread over both workers (different prompts, so no prefix pulls them together)
        for i in range(8):
            status, _, _ = await post(f"{gateway}/v1/chat/completions", chat(MODEL, f"topic {i} " * 40))
            assert status == 200
        client = await asyncio.create_subprocess_exec(
            sys.executable, str(REPO / "examples" / "openai_client.py"), "--base-url", f"{gateway}/v1",
            "--model", MODEL, "--priority", "high",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output = (await asyncio.wait_for(client.communicate(), 60))[0].decode()
        assert client.returncode == 0, output
        workers = {"static-" + url.removeprefix("http://").replace(":", "-") for url in urls}  # static ids
        for kind in ("plain", "streamed"):
            match = re.search(rf"^{kind}: +worker=(\S+) .*text='(.+)'$", output, flags=re.MULTILINE)
            assert match and match.group(1) in workers, output

        async def recorded() -> bool:
            return len(await read_recent(redis, 20)) >= 10

        await poll(recorded, 10, "the decision records of all 10 requests")
        records = await read_recent(redis, 20)
        assert {r["worker"] for r in records} == workers  # the recipe put both servers behind the gateway
        assert [r["band"] for r in records[:2]] == ["high", "high"]  # the client's default_headers
        assert {r["band"] for r in records[2:]} == {"normal"}
    except BaseException:
        print(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop_process(proc)
        for runner in runners:
            await runner.cleanup()
