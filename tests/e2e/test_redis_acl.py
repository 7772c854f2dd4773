"""A Redis ACL user limited to kvgate's keys, channels and commands (docs/REDIS.md "ACL user"): a real
redis-server whose default user is switched off, a `kvgate proxy` gateway and a `kvgate agent` that
reach it only as `redis://kvgate:PASSWORD@...`, and a request admitted and routed through it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError

from bench.stack import stop_process
from store.scripts import quota_key
from tests.e2e.faults import RedisProcess, send
from tests.e2e.harness import Gateway, chat, gateways, start_worker

pytestmark = pytest.mark.e2e

MODEL = "m"
# the minimal ACL, as documented in docs/REDIS.md
ACL = ("kvgate on >s3cret-acl resetkeys ~kvg:* resetchannels &kvg:* -@all +@read +@write +@scripting "
       "+@pubsub +@connection +@transaction +time -@dangerous")  # fmt: skip


async def test_gateway_and_agent_work_as_a_limited_acl_user(tmp_path: Path) -> None:
    proc = RedisProcess().start()
    admin = aioredis.Redis(port=proc.port)
    await admin.execute_command("ACL", "SETUSER", *ACL.split())
    await admin.execute_command("ACL", "SETUSER", "default", "off")  # only the kvgate user gets in
    url = f"redis://kvgate:s3cret-acl@127.0.0.1:{proc.port}/0"
    runner, worker_url = await start_worker(MODEL, "w1")
    config = tmp_path / "kvgate.toml"
    config.write_text(f'[models."{MODEL}"]\ntotal = 2\n[routing]\nrefresh_ms = 100\n')
    agent = subprocess.Popen(
        [sys.executable, "-m", "plugin.cli", "agent", "--worker-url", worker_url, "--model", MODEL,
         "--worker-id", "w1", "--redis", url, "--heartbeat-ms", "200"],
        stdout=(tmp_path / "agent.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    gw = Gateway(url, config=config, log_dir=tmp_path)
    try:
        async with gateways(gw):
            answer = await send(gw.url, chat(MODEL, "as an acl user"))
            assert answer.status == 200, answer.body[:300]
            assert answer.headers["x-kvgate-worker"] == "w1"  # registered by the agent as that user
            user = aioredis.Redis.from_url(url)
            assert (await user.hgetall(quota_key(MODEL)))[b"total"] == b"2"
            with pytest.raises(NoPermissionError):  # outside kvg:*
                await user.set("other", 1)
            with pytest.raises(NoPermissionError):  # a dangerous command
                await user.flushall()
            await user.aclose()
            anonymous = aioredis.Redis.from_url(f"redis://127.0.0.1:{proc.port}/0")
            with pytest.raises(AuthenticationError):
                await asyncio.wait_for(anonymous.ping(), 3)
            await anonymous.aclose()
            assert "Traceback" not in gw.output()
            assert "NOPERM" not in gw.output()
    finally:
        stop_process(agent, 5)
        await runner.cleanup()
        await admin.aclose()
        proc.stop()
    assert "NOPERM" not in (tmp_path / "agent.log").read_text()
