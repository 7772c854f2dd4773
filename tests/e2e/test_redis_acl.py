"""A Redis ACL user limited to kvgate's keys, channels and commands (docs/REDIS.md "ACL user"): a real
redis-server whose default user is switched off, a `kvgate proxy` gateway and a `kvgate agent` that
reach it only as `redis://kvgate:PASSWORD@...`, and a request admitted and routed through it; then
the same over TLS (`rediss://kvgate:PASSWORD@...?ssl_ca_certs=...`, a self-signed certificate made in
the test), refused without the CA and with a wrong password."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError

from bench.redis7 import start_tls_only, tls_redis_server
from bench.stack import stop_process
from store.redis_server import free_port
from store.scripts import quota_key
from tests.e2e.faults import RedisProcess, send
from tests.e2e.harness import Gateway, chat, gateways, poll, start_worker

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
    agent = start_agent(worker_url, url, tmp_path)
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


def start_agent(worker_url: str, redis_url: str, log_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "plugin.cli", "agent", "--worker-url", worker_url, "--model", MODEL,
         "--worker-id", "w1", "--redis", redis_url, "--heartbeat-ms", "200"],
        stdout=(log_dir / "agent.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip


async def test_gateway_and_agent_over_tls_as_an_acl_user(tmp_path: Path) -> None:
    found = tls_redis_server()
    if found is None:
        pytest.skip("no TLS-capable redis-server: set KVGATE_TLS_REDIS_SERVER (needs apt-get otherwise)")
    port = free_port()
    server, cert = start_tls_only(*found, tmp_path, port)
    admin = aioredis.Redis.from_url(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}")
    runner, worker_url = await start_worker(MODEL, "w1")
    agent: subprocess.Popen[bytes] | None = None
    try:

        async def serves() -> bool:
            try:
                return bool(await admin.ping())
            except ConnectionError:
                return False

        await poll(serves, 10, "the TLS redis-server")
        await admin.execute_command("ACL", "SETUSER", *ACL.split())
        await admin.execute_command("ACL", "SETUSER", "default", "off")
        url = f"rediss://kvgate:s3cret-acl@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        config = tmp_path / "kvgate.toml"
        config.write_text(f'[models."{MODEL}"]\ntotal = 2\n[routing]\nrefresh_ms = 100\n')
        agent = start_agent(worker_url, url, tmp_path)
        gw = Gateway(url, config=config, log_dir=tmp_path)
        async with gateways(gw):
            answer = await send(gw.url, chat(MODEL, "over tls as an acl user"))
            assert answer.status == 200, answer.body[:300]
            assert answer.headers["x-kvgate-worker"] == "w1"  # registered by the agent over TLS
            user = aioredis.Redis.from_url(url)
            assert (await user.hgetall(quota_key(MODEL)))[b"total"] == b"2"
            with pytest.raises(NoPermissionError):
                await user.set("other", 1)
            await user.aclose()
            assert "Traceback" not in gw.output() and "NOPERM" not in gw.output()
        # refused: the right password without the CA (the certificate is not trusted), and the CA
        # with a wrong password; a gateway given either exits at startup saying why, no password logged
        no_ca = f"rediss://kvgate:s3cret-acl@127.0.0.1:{port}/0"
        wrong = f"rediss://kvgate:wrong-pass@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        for bad, error, why in (
            (no_ca, ConnectionError, "certificate verify failed"),
            (wrong, AuthenticationError, "invalid username-password pair"),
        ):
            client = aioredis.Redis.from_url(bad)
            with pytest.raises(error, match=why):
                await asyncio.wait_for(client.ping(), 5)
            await client.aclose()
            refused = Gateway(bad, config=config, log_dir=tmp_path, gateway_id=f"refused-{error.__name__}")
            with pytest.raises(AssertionError, match="gateway exited with 1"):
                await refused.start(timeout_s=15)
            assert f"cannot reach Redis at rediss://kvgate:***@127.0.0.1:{port}" in refused.output()
            assert why in refused.output()
            assert "s3cret-acl" not in refused.output() and "wrong-pass" not in refused.output()
    finally:
        if agent is not None:
            stop_process(agent, 5)
        await runner.cleanup()
        await admin.aclose()
        server.kill()
        server.wait()
    assert "NOPERM" not in (tmp_path / "agent.log").read_text()
