"""Mooncake JSONL traces -> `SimRequest`s: the replay input of `kvgate bench sim --trace`.

One JSON object per line (kvcache-ai/Mooncake FAST25-release; shared/reference/PEERS.md §5):
`{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`. Each hash id
names a 512-token block *and everything before it* (equal id at position i => identical tokens 0..i),
so ids are used as given. The last block is partial: `input_length - 512 * (n - 1)` tokens.
Requests get ids 0, 1, ... in file order and arrival times in seconds relative to the first line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from bench.sim.types import SimRequest

TRACE_BLOCK_TOKENS = 512  # Mooncake hash block size


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names file:line and what is wrong."""


def block_token_counts(
    input_tokens: int, n_blocks: int, block_size: int = TRACE_BLOCK_TOKENS
) -> tuple[int, ...]:
    """Tokens in each block: full blocks, then the (possibly partial) remainder in the last one."""
    if n_blocks == 0:
        return ()
    last = input_tokens - block_size * (n_blocks - 1)
    return (block_size,) * (n_blocks - 1) + (last,)


def _int_field(record: dict[str, object], name: str, minimum: int, where: str) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise TraceError(f"{where}: field {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: field {name!r} must be >= {minimum}, got {value!r}")
    return int(value)


def parse_line(text: str, request_id: int, where: str) -> tuple[float, SimRequest]:
    """One trace line -> (timestamp in seconds, request with arrival 0); `where` is "file:line"."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    timestamp_ms = record.get("timestamp")
    if isinstance(timestamp_ms, bool) or not isinstance(timestamp_ms, int | float) or timestamp_ms < 0:
        raise TraceError(f"{where}: field 'timestamp' must be a number of ms >= 0, got {timestamp_ms!r}")
    input_tokens = _int_field(record, "input_length", 1, where)
    output_tokens = _int_field(record, "output_length", 1, where)
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
    expected = math.ceil(input_tokens / TRACE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_tokens}; "
            f"expected ceil({input_tokens}/{TRACE_BLOCK_TOKENS}) = {expected}"
        )
    req = SimRequest(
        id=request_id,
        arrival_s=0.0,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        block_ids=tuple(hash_ids),
        block_tokens=block_token_counts(input_tokens, len(hash_ids)),
    )
    return float(timestamp_ms) / 1000.0, req


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[tuple[float, SimRequest]]:
    """(timestamp_s, request) per non-blank line, at most `limit` requests."""
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot open trace ({e.strerror})") from None
    with handle:
        count = 0
        for line_no, text in enumerate(handle, start=1):
            if limit is not None and count >= limit:
                return
            if not text.strip():
                continue
            yield parse_line(text, count, f"{path}:{line_no}")
            count += 1


def load_trace(path: str | Path, limit: int | None = None) -> list[SimRequest]:
    """Requests of a Mooncake trace in arrival order, arrival times relative to the first request.

    Lines out of timestamp order are sorted stably (ids keep file order)."""
    rows = list(iter_trace(path, limit))
    if not rows:
        raise TraceError(f"{path}: trace has no requests")
    rows.sort(key=lambda row: row[0])
    start = rows[0][0]
    return [replace(req, arrival_s=ts - start) for ts, req in rows]
