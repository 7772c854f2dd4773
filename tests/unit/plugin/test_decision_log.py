"""Decision records are batched into a capped Redis stream in the background."""

from __future__ import annotations

import redis.asyncio as aioredis

from plugin.decision_log import DecisionLog, read_recent


async def test_records_reach_the_stream(redis: aioredis.Redis) -> None:
    log = DecisionLog(redis, maxlen=50, flush_ms=1)
    await log.start()
    for i in range(400):
        log.record({"request_id": f"r{i}", "candidates": {"w0": {"ttft": 0.1}}, "status": 200})
    await log.close()  # flushes what is left
    recent = await read_recent(redis, count=5)
    assert recent[0]["request_id"] == "r399"
    assert recent[0]["candidates"] == {"w0": {"ttft": 0.1}}
    assert await redis.xlen("kvg:decisions") < 400  # capped (MAXLEN ~ trims whole nodes)
    assert log.written == 400 and log.dropped == 0
