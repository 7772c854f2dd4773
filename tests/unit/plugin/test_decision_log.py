"""Decision records are batched into a capped Redis stream in the background."""

from __future__ import annotations

import json
import random

import redis.asyncio as aioredis

from plugin.decision_log import DecisionLog, _encode_one, read_recent


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


def test_blocks_encoded_apart_are_the_json_of_the_whole_record() -> None:
    """`prefix_hashes` and `block_tokens` from memoized texts: the same values json writes."""
    rng = random.Random(7)
    shared = [rng.getrandbits(64) for _ in range(20)]
    for i in range(300):
        hashes = tuple(shared[: rng.randrange(21)] + [rng.getrandbits(64) for _ in range(rng.randrange(5))])
        tokens = tuple(rng.choice((128, 16, 3)) for _ in hashes)
        entry: dict[str, object] = {"request_id": f"r{i}", "arrival_ms": rng.random() * 1e12, "status": 200}
        if i % 7 == 0:
            entry = {}
        line = _encode_one(entry, (hashes, list(tokens) if i % 2 else tokens))
        whole = {**entry, "prefix_hashes": list(hashes), "block_tokens": list(tokens)}
        assert json.loads(line) == whole
        assert len(line) == len(json.dumps(whole, separators=(",", ":")))
        assert line.startswith(json.dumps(entry, separators=(",", ":"))[:-1])  # the dict's own text
    assert _encode_one({"a": 1}) == '{"a":1}'


def test_a_record_is_the_text_json_writes() -> None:
    """The record encoder (a C encoder built once) writes what `json.dumps(separators=(",", ":"))`
    writes: nested scores, floats, None, booleans, non-ASCII and escaped text, key order."""
    rng = random.Random(3)
    for i in range(200):
        entry = {
            "request_id": f"r{i}", "arrival_ms": round(rng.random() * 1e12, 3), "stream": i % 2 == 0,
            "sticky_worker": None if i % 3 else "w1", "reason": 'prefix 0.98 on "w0" → least\n',
            "candidates": {f"w{j}": {"cost": rng.random(), "hit": rng.random() / 3} for j in range(i % 4)},
            "hits": {"w0": rng.randrange(40)}, "status": 200, "nan": float("inf") if i == 7 else 0.5,
        }  # fmt: skip
        assert _encode_one(entry) == json.dumps(entry, separators=(",", ":"))
