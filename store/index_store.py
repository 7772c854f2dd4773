"""The Redis side of the shared prefix -> worker index.

Writers: gateways in approximate mode (blocks of a request they just routed, and with hit feedback the
removal of a worker's entries its engine's reported cached tokens proved stale) and agents in exact
mode (blocks from the worker's KV events). Readers: every gateway keeps an in-process mirror (load a
snapshot once, then `tail` the log), so a routing decision costs no Redis round trip.

Layout (docs/REDIS.md), all under the model's hash tag:
- `kvg:{m}:idx:<worker>` ZSET block hash (16 hex digits) -> last use (ms), trimmed to the worker's
  capacity in blocks, least recently used first (bounded memory per worker);
- `kvg:{m}:idx-workers` SET of workers that have entries (so a snapshot needs no SCAN);
- `kvg:{m}:idx:log` STREAM of ops `op` (add/remove/clear), `worker`, `hashes` (comma-separated hex),
  `seq` (dense counter `kvg:{m}:idx-seq`, so a reader detects entries trimmed before it read them),
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
from redis.exceptions import RedisError

from store import keys
from store.scripting import LuaScript, load

LOG_MAXLEN = 20_000  # approximate cap of the op log; a mirror further behind must resnapshot (IndexLogGap)
DEFAULT_CAPACITY_BLOCKS = 1 << 16  # per-worker bound when the worker's KV capacity is unknown
HASH_MASK = (1 << 64) - 1


def index_key(model: str, worker: str) -> str:
    if worker == "log":
        raise ValueError("worker id 'log' is reserved (kvg:{m}:idx:log is the index log)")
    return keys.model_key(model, "idx", worker)


def members_key(model: str) -> str:
    return keys.model_key(model, "idx-workers")


def seq_key(model: str) -> str:
    return keys.model_key(model, "idx-seq")


def _keys(model: str, worker: str) -> tuple[str, str, str, str]:
    return (index_key(model, worker), members_key(model), log_key(model), seq_key(model))


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
    seq: int = 0  # position in the log (dense, from 1); 0 = not from the log


# Scripts: store/lua/index_{add,remove,clear}.lua after index_common.lua (same KEYS for all, a logged,
# sequence-numbered change each).
_ADD = load("index_add.lua", prelude="index_common.lua")
_REMOVE = load("index_remove.lua", prelude="index_common.lua")
_CLEAR = load("index_clear.lua", prelude="index_common.lua")
_FORGET_BEFORE = load("index_forget_before.lua", prelude="index_common.lua")


async def _eval(redis: aioredis.Redis, script: LuaScript, keys_: Sequence[str], args: Sequence[Any]) -> Any:
    return await script(redis, keys_, args)


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
            redis, _ADD, _keys(model, worker), (worker, LOG_MAXLEN, capacity, ",".join(members), *pairs)
        )
    )


async def remove_blocks(redis: aioredis.Redis, model: str, worker: str, hashes: Sequence[int]) -> int:
    """Record that `worker` no longer holds `hashes`; returns how many entries were removed."""
    if not hashes:
        return 0
    members = [to_hex(h) for h in hashes]
    return int(
        await _eval(redis, _REMOVE, _keys(model, worker), (worker, LOG_MAXLEN, ",".join(members), *members))
    )


async def forget_before(
    redis: aioredis.Redis, model: str, worker: str, before_ms: int, keep: Sequence[int] = ()
) -> int:
    """Drop `worker`'s entries last used before `before_ms` except `keep` (hit feedback: the reporting
    request's own blocks, which its prefill cached again); returns how many."""
    kept = [to_hex(h) for h in keep]
    return int(
        await _eval(redis, _FORGET_BEFORE, _keys(model, worker), (worker, LOG_MAXLEN, before_ms, *kept))
    )


async def clear_worker(redis: aioredis.Redis, model: str, worker: str) -> int:
    """Drop every entry of `worker` (restart, cache reset, deregistration); returns how many."""
    return int(await _eval(redis, _CLEAR, _keys(model, worker), (worker, LOG_MAXLEN)))


class IndexLogGap(RedisError):
    """Entries after the cursor were trimmed from the log before this reader saw them: load a new snapshot.

    A `RedisError`, so a reader that reloads on Redis errors recovers without special handling.
    """


def _split_cursor(cursor: str) -> tuple[str, int | None]:
    """`"<stream id>@<seq>"` -> (stream id, seq); a bare stream id ("0-0", "$") has no seq."""
    stream_id, _, seq = cursor.partition("@")
    return stream_id, int(seq) if seq else None


async def log_cursor(redis: aioredis.Redis, model: str) -> str:
    """Where the log ends now, as `"<stream id>@<seq>"`: tail from here after loading a snapshot."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xrevrange(log_key(model), count=1)
        pipe.get(seq_key(model))
        newest, counter = await pipe.execute()
    if not newest:
        return f"0-0@{int(counter or 0)}"
    entry_id, fields = newest[0]
    return f"{_text(entry_id)}@{parse_entry(fields).seq}"


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
    seq = int(text.get("seq", "0") or 0)
    return IndexOp(op=text.get("op", ""), worker=text.get("worker", ""), hashes=hashes, seq=seq)


async def tail(
    redis: aioredis.Redis, model: str, cursor: str, block_ms: int | None = None, count: int = 1000
) -> tuple[str, list[IndexOp]]:
    """Log entries after `cursor` (at most `count`), waiting up to `block_ms` if there are none.

    Returns the cursor to pass next time and the ops in log order. `cursor` comes from `log_cursor`
    (or a previous `tail`); a bare stream id such as "0-0" works too, without gap detection.
    Raises IndexLogGap when entries after the cursor were trimmed away (the reader fell more than
    LOG_MAXLEN entries behind). `block_ms=None` does not wait. Use a dedicated connection when
    blocking: XREAD BLOCK holds it.
    """
    last_id, last_seq = _split_cursor(cursor)
    reply: Any = await redis.xread({log_key(model): last_id}, count=count, block=block_ms)
    if not reply:
        return cursor, []
    ops = []
    for entry_id, fields in reply[0][1]:  # [[stream, [(id, fields), ...]]] (RESP2 clients)
        last_id = _text(entry_id)
        ops.append(parse_entry(fields))
    if last_seq is not None and ops[0].seq > last_seq + 1:
        raise IndexLogGap(
            f"index log of {model}: entries {last_seq + 1}..{ops[0].seq - 1} were trimmed unread"
        )
    return (f"{last_id}@{ops[-1].seq}" if ops[-1].seq else last_id), ops


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
