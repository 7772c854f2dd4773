"""The Redis side of the shared prefix -> worker index.

Writers: gateways in approximate mode (blocks of a request they just routed) and agents in exact mode
(blocks from the worker's KV events). Readers: every gateway keeps an in-process mirror (load a
snapshot once, then `tail` the log), so a routing decision costs no Redis round trip.

Layout (docs/REDIS.md), all under the model's hash tag:
- `kvg:{m}:idx:<worker>` ZSET block hash (16 hex digits) -> last use (ms), trimmed to the worker's
  capacity in blocks, least recently used first (bounded memory per worker);
- `kvg:{m}:idx-workers` SET of workers that have entries (so a snapshot needs no SCAN);
- `kvg:{m}:idx:log` STREAM of ops `op` (add/remove/clear), `worker`, `hashes` (comma-separated hex),
  capped with `MAXLEN ~`. Blocks evicted by the capacity trim are logged as a `remove`, so a mirror
  that applies the log in order holds exactly what Redis holds.

Every op is last-writer-wins per (worker, hash), so replaying ops a snapshot already contains is
harmless: read the cursor first (`log_cursor`), then the snapshot, then tail from the cursor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from policy import keys

LOG_MAXLEN = 100_000  # approximate cap of the op log; a mirror further behind than this must resnapshot
DEFAULT_CAPACITY_BLOCKS = 1 << 16  # per-worker bound when the worker's KV capacity is unknown
HASH_MASK = (1 << 64) - 1


def index_key(model: str, worker: str) -> str:
    if worker == "log":
        raise ValueError("worker id 'log' is reserved (kvg:{m}:idx:log is the index log)")
    return keys.model_key(model, "idx", worker)


def members_key(model: str) -> str:
    return keys.model_key(model, "idx-workers")


def log_key(model: str) -> str:
    return keys.model_key(model, "idx:log")


def to_hex(block_hash: int) -> str:
    """A 64-bit block hash as 16 lower-case hex digits (negative ints are taken mod 2**64)."""
    return f"{block_hash & HASH_MASK:016x}"


def from_hex(text: str | bytes) -> int:
    return int(text, 16)


@dataclass(frozen=True, slots=True)
class IndexOp:
    """One entry of the index log, as a mirror applies it."""

    op: str  # "add" | "remove" | "clear"
    worker: str
    hashes: tuple[int, ...] = ()


# KEYS[1] kvg:{m}:idx:<worker>  KEYS[2] kvg:{m}:idx-workers  KEYS[3] kvg:{m}:idx:log
# ARGV[1] worker  ARGV[2] capacity (blocks)  ARGV[3] log maxlen  ARGV[4] hashes (comma-separated hex)
# ARGV[5..] score, member pairs for ZADD
# returns the number of blocks evicted by the capacity trim (they are logged as a remove)
_ADD = """
redis.call('ZADD', KEYS[1], unpack(ARGV, 5))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'op', 'add', 'worker', ARGV[1], 'hashes', ARGV[4])
local excess = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[2])
if excess <= 0 then return 0 end
local evicted = redis.call('ZRANGE', KEYS[1], 0, excess - 1)
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'op', 'remove', 'worker', ARGV[1],
           'hashes', table.concat(evicted, ','))
return excess
"""

# KEYS[1] kvg:{m}:idx:<worker>  KEYS[2] kvg:{m}:idx:log
# ARGV[1] worker  ARGV[2] log maxlen  ARGV[3] hashes (comma-separated hex)  ARGV[4..] members
# returns the number of entries removed
_REMOVE = """
local removed = redis.call('ZREM', KEYS[1], unpack(ARGV, 4))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'op', 'remove', 'worker', ARGV[1], 'hashes', ARGV[3])
return removed
"""

# KEYS[1] kvg:{m}:idx:<worker>  KEYS[2] kvg:{m}:idx-workers  KEYS[3] kvg:{m}:idx:log
# ARGV[1] worker  ARGV[2] log maxlen   returns the number of entries dropped
_CLEAR = """
local n = redis.call('ZCARD', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'op', 'clear', 'worker', ARGV[1], 'hashes', '')
return n
"""


async def _eval(redis: aioredis.Redis, script: str, keys_: Sequence[str], args: Sequence[Any]) -> Any:
    return await redis.register_script(script)(keys=list(keys_), args=list(args))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def add_blocks(
    redis: aioredis.Redis,
    model: str,
    worker: str,
    hashes: Sequence[int],
    now_ms: int,
    capacity_blocks: int = 0,
) -> int:
    """Record that `worker` holds `hashes` (block 0 first) as of `now_ms`; trim to capacity.

    Within one call, earlier blocks get a slightly later score, so a trim evicts a prefix's tail
    before its head (as an engine's LRU does: the head is shared by more requests).
    `capacity_blocks` <= 0 means unknown: DEFAULT_CAPACITY_BLOCKS. Returns the blocks evicted.
    """
    if not hashes:
        return 0
    capacity = capacity_blocks if capacity_blocks > 0 else DEFAULT_CAPACITY_BLOCKS
    members = [to_hex(h) for h in hashes]
    n = len(members)
    pairs: list[str | float] = []
    for i, member in enumerate(members):
        pairs += [now_ms + (n - i) / (n + 1), member]
    return int(
        await _eval(
            redis,
            _ADD,
            (index_key(model, worker), members_key(model), log_key(model)),
            (worker, capacity, LOG_MAXLEN, ",".join(members), *pairs),
        )
    )


async def remove_blocks(redis: aioredis.Redis, model: str, worker: str, hashes: Sequence[int]) -> int:
    """Record that `worker` no longer holds `hashes`; returns how many entries were removed."""
    if not hashes:
        return 0
    members = [to_hex(h) for h in hashes]
    return int(
        await _eval(
            redis,
            _REMOVE,
            (index_key(model, worker), log_key(model)),
            (worker, LOG_MAXLEN, ",".join(members), *members),
        )
    )


async def clear_worker(redis: aioredis.Redis, model: str, worker: str) -> int:
    """Drop every entry of `worker` (restart, cache reset, deregistration); returns how many."""
    return int(
        await _eval(
            redis,
            _CLEAR,
            (index_key(model, worker), members_key(model), log_key(model)),
            (worker, LOG_MAXLEN),
        )
    )


async def log_cursor(redis: aioredis.Redis, model: str) -> str:
    """The id of the newest log entry ("0-0" if none): tail from here after loading a snapshot."""
    newest = await redis.xrevrange(log_key(model), count=1)
    return _text(newest[0][0]) if newest else "0-0"


async def load_snapshot(redis: aioredis.Redis, model: str) -> dict[str, list[int]]:
    """Every worker's blocks, most recently used first (two round trips)."""
    workers = sorted(_text(w) for w in await redis.smembers(members_key(model)))
    if not workers:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for worker in workers:
            pipe.zrevrange(index_key(model, worker), 0, -1)
        replies = await pipe.execute()
    return {w: [from_hex(m) for m in members] for w, members in zip(workers, replies, strict=True) if members}


async def load_snapshot_with_cursor(redis: aioredis.Redis, model: str) -> tuple[str, dict[str, list[int]]]:
    """`(cursor, snapshot)`, cursor read first so that tailing from it misses nothing."""
    cursor = await log_cursor(redis, model)
    return cursor, await load_snapshot(redis, model)


def parse_entry(fields: dict[Any, Any]) -> IndexOp:
    """One stream entry's fields as an `IndexOp`."""
    text = {_text(k): _text(v) for k, v in fields.items()}
    raw_hashes = text.get("hashes", "")
    hashes = tuple(from_hex(h) for h in raw_hashes.split(",") if h)
    return IndexOp(op=text.get("op", ""), worker=text.get("worker", ""), hashes=hashes)


async def tail(
    redis: aioredis.Redis, model: str, last_id: str, block_ms: int | None = None, count: int = 1000
) -> tuple[str, list[IndexOp]]:
    """Log entries after `last_id` (at most `count`), waiting up to `block_ms` if there are none.

    Returns the id to pass next time and the ops in log order. `block_ms=None` does not wait. Use
    a dedicated connection when blocking: XREAD BLOCK holds it.
    """
    reply: Any = await redis.xread({log_key(model): last_id}, count=count, block=block_ms)
    if not reply:
        return last_id, []
    ops = []
    for entry_id, fields in reply[0][1]:  # [[stream, [(id, fields), ...]]] (RESP2 clients)
        last_id = _text(entry_id)
        ops.append(parse_entry(fields))
    return last_id, ops


def apply_ops(mirror: dict[str, dict[int, None]], ops: Iterable[IndexOp]) -> None:
    """Apply log ops to a plain mirror {worker: ordered set of hashes}; a reference for gateway mirrors."""
    for op in ops:
        held = mirror.setdefault(op.worker, {})
        if op.op == "add":
            for h in op.hashes:
                held.pop(h, None)
                held[h] = None
        elif op.op == "remove":
            for h in op.hashes:
                held.pop(h, None)
        elif op.op == "clear":
            mirror.pop(op.worker, None)
