"""A worker restart the agent sees: the consumer forgets the old publisher's sequence numbers (real Redis)."""

from __future__ import annotations

import time

import msgpack
import redis.asyncio as aioredis

from agent.kv_consumer import KvEventConsumer
from policy.prefix import token_block_hashes
from store import index_store

MODEL = "m"
TOPIC = b"kv@w1@m"


def frames(seq: int, *events: object) -> list[bytes]:
    return [TOPIC, seq.to_bytes(8, "big"), msgpack.packb([time.time(), list(events), 0])]


def stored(engine_hash: int, tokens: list[int]) -> list[object]:
    return ["BlockStored", [engine_hash], None, tokens, 16, None, "GPU"]


async def test_after_a_restart_the_new_publishers_first_batches_are_indexed(redis: aioredis.Redis) -> None:
    consumer = KvEventConsumer(redis, endpoint="tcp://127.0.0.1:1", model=MODEL, worker_id="w1",
                               clock_ms=lambda: int(time.time() * 1000))  # fmt: skip
    old, new = list(range(100, 116)), list(range(200, 216))
    for seq in range(40):  # the old process published 40 batches
        await consumer.handle_message(frames(seq, stored(1000 + seq, old)))
    consumer.forget()  # the agent saw the worker come back (agent/app.py clear_index)
    await index_store.clear_worker(redis, MODEL, "w1")
    # the new process numbers from 0; its first batches went out before the SUB socket reconnected
    await consumer.handle_message(frames(3, stored(7, new)))
    key = token_block_hashes(new, model=MODEL, block_size=16)[0][0]
    assert (await index_store.load_snapshot(redis, MODEL)).get("w1") == [key]
    assert consumer.stats.late == 0
