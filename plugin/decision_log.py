"""The per-request decision record: candidates and their scores, the winner and why, then the outcome.

Records are queued in memory on the hot path and written by one background task, batched into one
pipeline of `XADD kvg:decisions MAXLEN ~ N * record <json>` per flush (one write on the gateway's
lean connection, store/resp.py: redis-py's pipeline costs several times more CPU per record), so
logging never adds a Redis round trip to a request. Optionally each record also goes to the Python
log (logger `plugin.decision_log`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from runtime.tasks import cancel_and_wait, spawn
from store.resp import RespChannel

logger = logging.getLogger(__name__)

STREAM_KEY = "kvg:decisions"
MAX_BUFFER = 10_000  # records kept while Redis is unreachable; older ones are dropped


class DecisionLog:
    def __init__(
        self,
        redis: aioredis.Redis | None,
        *,
        maxlen: int = 10_000,
        to_log: bool = False,
        flush_ms: int = 100,
    ) -> None:
        self.redis = redis
        self._fast = RespChannel.for_client(redis) if redis is not None else None
        self.maxlen = maxlen
        self.to_log = to_log
        self.flush_ms = flush_ms
        self._buffer: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.written = 0
        self.dropped = 0

    def record(self, entry: dict[str, Any]) -> None:
        """Queue one record (hot path: a list append)."""
        if self.to_log:
            logger.info("decision %s", json.dumps(entry, separators=(",", ":")))
        if self.redis is None:
            return
        if len(self._buffer) >= MAX_BUFFER:
            self._buffer.pop(0)
            self.dropped += 1
        self._buffer.append(entry)
        self._wake.set()

    async def start(self) -> None:
        if self.redis is not None:
            self._task = spawn(self._flush_loop(), name="kvgate-decision-log")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        await self.flush()
        if self._fast is not None:
            await self._fast.aclose()

    async def flush(self) -> None:
        if not self._buffer or self.redis is None:
            return
        batch, self._buffer = self._buffer, []
        try:
            if self._fast is not None:  # one JSON field per record: packing many fields costs more CPU
                head = ("XADD", STREAM_KEY, "MAXLEN", "~", self.maxlen, "*", "record")
                await self._fast.pipeline([(*head, json.dumps(entry)) for entry in batch])
            else:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for entry in batch:
                        pipe.xadd(
                            STREAM_KEY, {"record": json.dumps(entry)}, maxlen=self.maxlen, approximate=True
                        )
                    await pipe.execute()
            self.written += len(batch)
        except (RedisError, OSError) as e:
            logger.warning("decision log write failed (%d records dropped): %s", len(batch), e)
            self.dropped += len(batch)

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.flush_ms / 1000)
            await self.flush()


async def read_recent(redis: aioredis.Redis, count: int = 100) -> list[dict[str, Any]]:
    """The newest records, newest first (for tests and operators)."""
    out = []
    for _, fields in await redis.xrevrange(STREAM_KEY, count=count) or []:
        raw = {_text(k): _text(v) for k, v in (fields or {}).items()}
        out.append(json.loads(raw["record"]) if "record" in raw else raw)
    return out


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
