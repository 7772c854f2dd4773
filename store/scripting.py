"""The one Lua loader: every Redis script kvgate runs is a file under store/lua/.

Each file opens with a comment header naming its KEYS, its ARGV and what it returns
(tests/unit/store/test_scripting.py checks it). A script may be prepended with a shared prelude
(`common.lua` for admission, `index_common.lua` for the prefix index). `load()` reads a script once per
process and hashes it once; a call is one EVALSHA, and only a `NOSCRIPT` reply (a fresh server, or
after `SCRIPT FLUSH`) costs a `SCRIPT LOAD` and a retry.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError


@dataclass(frozen=True, slots=True)
class LuaScript:
    """One script's source and SHA1, callable on any client (or queued on a pipeline)."""

    name: str
    source: str
    sha: str

    async def __call__(self, redis: aioredis.Redis, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await redis.script_load(self.source)
            return await redis.evalsha(self.sha, len(keys), *keys, *args)

    def queue(self, pipe: Pipeline, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """Queue the EVALSHA on `pipe`; on `NoScriptError` from `execute`: `ensure_loaded()`, send again."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    async def ensure_loaded(self, redis: aioredis.Redis) -> None:
        await redis.script_load(self.source)


def source(name: str) -> str:
    """The text of store/lua/<name>."""
    return importlib.resources.files("store").joinpath("lua", name).read_text(encoding="utf-8")


@functools.cache
def load(name: str, prelude: str | None = None) -> LuaScript:
    """store/lua/<name>, after store/lua/<prelude> when given; read and hashed once per process."""
    text = source(name) if prelude is None else source(prelude) + "\n" + source(name)
    return LuaScript(name, text, hashlib.sha1(text.encode("utf-8")).hexdigest())
