"""store/scripting.py: every script is a file with a KEYS/ARGV/returns header, loaded once, and runs after
a SCRIPT FLUSH (NOSCRIPT is answered by a load and a retry)."""

from __future__ import annotations

import importlib.resources

import pytest
import redis.asyncio as aioredis

from store import registry
from store.registry import WorkerRecord
from store.scripting import load, source

LUA = sorted(
    p.name for p in importlib.resources.files("store").joinpath("lua").iterdir() if p.name.endswith(".lua")
)


@pytest.mark.parametrize("name", LUA)
def test_every_script_opens_with_a_keys_argv_returns_header(name: str) -> None:
    lines = source(name).splitlines()
    header = []
    for line in lines:
        if not line.startswith("--"):
            break
        header.append(line)
    text = "\n".join(header)
    assert header and header[0].startswith(f"-- {name}:"), f"{name}: the header names the file first"
    for word in ("KEYS", "ARGV", "returns"):
        assert word in text, f"{name}: the header does not say its {word}"


def test_a_script_is_read_and_hashed_once_per_process() -> None:
    assert load("registry_read.lua") is load("registry_read.lua")
    with_prelude = load("index_add.lua", prelude="index_common.lua")
    assert with_prelude.source.startswith(source("index_common.lua"))
    assert with_prelude.source.endswith(source("index_add.lua"))


async def test_scripts_run_again_after_a_script_flush(redis: aioredis.Redis) -> None:
    record = WorkerRecord(id="w1", model="m", url="http://127.0.0.1:1")
    assert await registry.register(redis, record, lease_ms=1000, now_ms=0) == 1
    await redis.script_flush()
    assert await registry.register(redis, record, lease_ms=1000, now_ms=0) == 2  # pipelined EVALSHA
    await redis.script_flush()
    assert [r.id for r in await registry.read_workers(redis, "m", now_ms=0)] == ["w1"]  # plain EVALSHA
    assert await redis.sismember("kvg:models", "m")
