"""The per-request decision record: candidates and their scores, the winner and why, then the outcome.

One record per request, refused ones included (plugin/release.py builds them; the fields are listed
in docs/OPERATIONS.md "Decision log"). Records are queued in memory on the hot path and written by one
background task, never on a request's path (it encodes a batch itself: handing it to a thread cost
more CPU, bench.hook_cost), as one pipeline of `XADD kvg:decisions MAXLEN ~ N * record <json>` per
flush (one write on the gateway's lean connection, store/resp.py: redis-py's pipeline costs several
times more CPU per record), so logging never adds a Redis round trip to a request. Optionally each
record also goes to a JSON-lines file, written from a thread (rotated once to PATH.1 at its size cap,
so it is bounded), and to the Python log (logger `plugin.decision_log`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from runtime.tasks import cancel_and_wait, spawn
from store.resp import RespChannel, head, pack

logger = logging.getLogger(__name__)

STREAM_KEY = "kvg:decisions"
MAX_BUFFER = 10_000  # records kept while Redis is unreachable; older ones are dropped
# a record's prefix blocks, kept apart from its dict: (prefix_hashes, block_tokens)
Blocks = tuple[Sequence[int], Sequence[int]]


class DecisionLog:
    def __init__(
        self,
        redis: aioredis.Redis | None,
        *,
        maxlen: int = 10_000,
        to_log: bool = False,
        flush_ms: int = 100,
        file: str = "",
        file_max_bytes: int = 100 << 20,
    ) -> None:
        self.redis = redis
        self.file = Path(file) if file else None
        self.file_max_bytes = file_max_bytes
        self._fast = RespChannel.for_client(redis) if redis is not None else None
        self.maxlen = maxlen
        self.to_log = to_log
        self.flush_ms = flush_ms
        self._buffer: list[tuple[dict[str, Any], Blocks | None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.written = 0
        self.dropped = 0

    def record(self, entry: dict[str, Any], blocks: Blocks | None = None) -> None:
        """Queue one record (hot path: a list append). `blocks`, the request's prefix hashes and block
        tokens, become the record's `prefix_hashes` and `block_tokens` (encoded apart: `_encode_one`)."""
        if self.to_log:
            logger.info("decision %s", _encode_one(entry, blocks))
        if self.redis is None and self.file is None:
            return
        if len(self._buffer) >= MAX_BUFFER:
            self._buffer.pop(0)
            self.dropped += 1
        self._buffer.append((entry, blocks))
        self._wake.set()

    async def start(self) -> None:
        if self.redis is not None or self.file is not None:
            self._task = spawn(self._flush_loop(), name="kvgate-decision-log")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        await self.flush()
        if self._fast is not None:
            await self._fast.aclose()

    async def flush(self) -> None:
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        lines = _encode(batch)
        if self.file is not None:
            try:
                await asyncio.to_thread(_append, self.file, lines, self.file_max_bytes)
            except OSError as e:
                logger.warning("decision log file %s: %s (%d records not written)", self.file, e, len(lines))
        if self.redis is None:
            self.written += len(batch)
            return
        try:
            if self._fast is not None:  # one JSON field per record: packing many fields costs more CPU
                first = head("XADD", STREAM_KEY, "MAXLEN", "~", self.maxlen, "*", "record")  # once a batch
                await self._fast.pipeline_packed([pack((line,), first) for line in lines])
            else:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for line in lines:
                        pipe.xadd(STREAM_KEY, {"record": line}, maxlen=self.maxlen, approximate=True)
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


def _dict_encoder() -> Callable[[dict[str, Any]], str]:
    """`json.JSONEncoder(separators=(",", ":")).encode` with its C encoder built once: `encode` builds
    one per call (and `json.dumps` with options a whole JSONEncoder). The same text for any record;
    without the circular-reference check, which a record (a tree of dicts, lists and scalars we build)
    never needs."""
    encoder = json.JSONEncoder(separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator: the encoder as it is
        return encoder.encode
    # the arguments JSONEncoder.iterencode passes (markers None: check_circular off)
    chunks = make(
        None, encoder.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
    return lambda entry: "".join(chunks(entry, 0))


_encode_dict = _dict_encoder()  # one encoder for every record
HASH_TEXTS_MAX = 50_000  # decimal texts of block hashes kept (~5 MB); cleared when full
TOKENS_TEXTS_MAX = 1_000  # JSON texts of block-token lists kept


class _HashTexts(dict[int, str]):
    """Block hash -> its decimal text: a shared prefix's hashes recur in record after record, and
    int -> str of a 64-bit hash was most of a record's encoding (bench.hook_cost, callgrind)."""

    def __missing__(self, h: int) -> str:
        text = self[h] = str(h)
        return text


_hash_texts = _HashTexts()
_tokens_texts: dict[tuple[int, ...], str] = {}


def _encode_one(entry: dict[str, Any], blocks: Blocks | None = None) -> str:
    """The record's JSON: `entry` with `prefix_hashes` and `block_tokens` from `blocks` (the same JSON
    values `json` writes for them, from memoized texts)."""
    line = _encode_dict(entry)
    if blocks is None:
        return line
    hashes, tokens = blocks
    key = tokens if isinstance(tokens, tuple) else tuple(tokens)
    tokens_text = _tokens_texts.get(key)
    if tokens_text is None:
        if len(_tokens_texts) >= TOKENS_TEXTS_MAX:
            _tokens_texts.clear()
        tokens_text = _tokens_texts[key] = "[" + ",".join(map(str, key)) + "]"
    if len(_hash_texts) >= HASH_TEXTS_MAX:
        _hash_texts.clear()
    hashes_text = ",".join(map(_hash_texts.__getitem__, hashes))
    sep = "," if len(line) > 2 else ""
    return f'{line[:-1]}{sep}"prefix_hashes":[{hashes_text}],"block_tokens":{tokens_text}}}'


def _encode(batch: list[tuple[dict[str, Any], Blocks | None]]) -> list[str]:
    return [_encode_one(entry, blocks) for entry, blocks in batch]


def _append(path: Path, lines: list[str], max_bytes: int) -> None:
    """Append JSON lines; once the file reaches `max_bytes` it becomes PATH.1 (the older one goes)."""
    try:
        if path.stat().st_size >= max_bytes:
            os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
    with path.open("a", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")


async def read_recent(redis: aioredis.Redis, count: int = 100) -> list[dict[str, Any]]:
    """The newest records, newest first (for tests and operators)."""
    out = []
    for _, fields in await redis.xrevrange(STREAM_KEY, count=count) or []:
        raw = {_text(k): _text(v) for k, v in (fields or {}).items()}
        out.append(json.loads(raw["record"]) if "record" in raw else raw)
    return out


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
