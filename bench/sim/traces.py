"""Trace files -> `SimRequest`s: the replay input of `kvgate bench sim --trace` (Mooncake JSONL; WEKA below).

One JSON object per line (kvcache-ai/Mooncake FAST25-release; shared/reference/PEERS.md §5):
`{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`. Each hash id
names a 512-token block *and everything before it* (equal id at position i => identical tokens 0..i),
so ids are used as given. The last block is partial: `input_length - 512 * (n - 1)` tokens.
Requests get ids 0, 1, ... in file order and arrival times in seconds relative to the first line.
"""

from __future__ import annotations

import json
import math
import random
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
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


# --- WEKA agentic-coding traces (kv-cache-tester format) ------------------------------------------------

WEKA_BLOCK_TOKENS = 64  # the kv-cache-tester's chunk size: one hash id per full 64-token block
WEKA_GROUP = TRACE_BLOCK_TOKENS // WEKA_BLOCK_TOKENS  # 64-token ids chained into one 512-token block


@dataclass(frozen=True, slots=True)
class WekaOptions:
    """How a WEKA trace set becomes one open-loop workload (every choice seeded by `seed`).

    conversations  how many conversations to replay, drawn at random without replacement among those
                   with at least one request left after the caps (None: all of them);
    window_s       each conversation starts at an offset drawn uniformly from [0, window_s);
    max_context    requests whose input + output tokens exceed it are dropped, as the engine would
                   refuse them (None: keep all); the CLI defaults it to the profile's max context;
    duration_s     a conversation is kept for its first `duration_s` seconds (None: all of it).
    """

    conversations: int | None = 80
    window_s: float = 1800.0
    max_context: int | None = None
    duration_s: float | None = 3600.0
    seed: int = 1


@dataclass(frozen=True, slots=True)
class _WekaCall:
    """One model call of a conversation, its time relative to the conversation's start."""

    t: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def is_weka_source(path: str | Path) -> bool:
    """A directory or a tar archive: what `--trace-format auto` replays as WEKA traces."""
    p = Path(path)
    return p.is_dir() or p.name.endswith((".tar", ".tar.gz", ".tgz"))


def load_weka(path: str | Path, options: WekaOptions | None = None) -> list[SimRequest]:
    """Requests of a WEKA trace set (a directory of trace JSON files, or a tar of them) in arrival order.

    Format (trace_replay_tester.md): per file `{"block_size": 64, "hash_id_scope": "local", "requests":
    [...]}`; a request has `t` (s from the conversation's start), `in`, `out`, and `hash_ids` for its
    full 64-token blocks (`in // 64` of them; the tail has none); think times are already inside the
    gaps of `t`. An entry of type `subagent` nests the requests of a sub-agent started at its `t`, their
    own `t` relative to that start; they replay as concurrent calls. Local ids are scoped to their file
    (sub-agents included), so the same id in two files means different content. Every 8 ids are
    chained into one 512-token block id (a block names its content and everything before it, the
    Mooncake semantics the simulator uses); a final group with fewer ids, or with the tail, is a
    shorter last block, and a tail always makes it unique to its request (unhashed content).
    """
    options = options or WekaOptions()
    source = Path(path)
    names = _weka_names(source)
    if not names:
        raise TraceError(f"{source}: no trace JSON files found")
    rng = random.Random(options.seed)
    order = list(names)
    rng.shuffle(order)
    wanted = len(order) if options.conversations is None else options.conversations
    if wanted <= 0:
        raise TraceError(f"conversations must be > 0, got {wanted}")
    chosen: list[tuple[str, list[_WekaCall]]] = []
    cursor = 0
    while len(chosen) < wanted and cursor < len(order):  # refill when caps empty a conversation
        batch = order[cursor : cursor + wanted - len(chosen)]
        cursor += len(batch)
        texts = _read_weka(source, batch)
        for name in batch:
            calls = _kept_calls(_parse_weka(texts[name], f"{source}:{name}"), options)
            if calls:
                chosen.append((name, calls))
    if not chosen:
        raise TraceError(f"{source}: no request is left after the context and duration caps")
    offsets = [rng.uniform(0.0, options.window_s) if options.window_s > 0 else 0.0 for _ in chosen]
    blocks = _Chainer()
    rows: list[tuple[float, int, int, SimRequest]] = []
    for conv, ((_, calls), offset) in enumerate(zip(chosen, offsets, strict=True)):
        for k, call in enumerate(calls):
            ids, sizes = blocks.chain(conv, call)
            req = SimRequest(
                0, 0.0, call.input_tokens, call.output_tokens, ids, sizes,
                session=f"weka-{conv}", session_close=k == len(calls) - 1,  # one client session each
            )  # fmt: skip
            rows.append((offset + call.t, conv, k, req))
    rows.sort(key=lambda row: row[:3])
    start = rows[0][0]
    return [replace(req, id=i, arrival_s=at - start) for i, (at, _, _, req) in enumerate(rows)]


def _kept_calls(calls: list[_WekaCall], options: WekaOptions) -> list[_WekaCall]:
    cap, duration = options.max_context, options.duration_s
    return [
        c
        for c in calls
        if (cap is None or c.input_tokens + c.output_tokens <= cap) and (duration is None or c.t <= duration)
    ]


def _weka_names(source: Path) -> list[str]:
    """The trace files of a directory or tar, sorted (their order is the seed's reference)."""
    if source.is_dir():
        return sorted(p.name for p in source.glob("*.json") if p.is_file())
    try:
        with tarfile.open(source) as tar:
            return sorted(m.name for m in tar if m.isfile() and m.name.endswith(".json"))
    except FileNotFoundError:
        raise TraceError(f"{source}: no such directory or tar archive") from None
    except (OSError, tarfile.TarError) as e:
        raise TraceError(f"{source}: cannot read as a tar archive of trace JSON files ({e})") from None


def _read_weka(source: Path, names: Sequence[str]) -> dict[str, bytes]:
    """Contents of the named trace files (one pass over a tar, in archive order)."""
    if source.is_dir():
        return {n: (source / n).read_bytes() for n in names}
    wanted = set(names)
    out: dict[str, bytes] = {}
    with tarfile.open(source) as tar:
        for member in tar:
            if member.name in wanted:
                handle = tar.extractfile(member)
                if handle is not None:
                    out[member.name] = handle.read()
    return out


def _parse_weka(text: bytes, where: str) -> list[_WekaCall]:
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("requests"), list):
        raise TraceError(f"{where}: expected a JSON object with a 'requests' list")
    block = record.get("block_size", WEKA_BLOCK_TOKENS)
    if block != WEKA_BLOCK_TOKENS:
        raise TraceError(f"{where}: block_size {block!r} is not supported (only {WEKA_BLOCK_TOKENS})")
    calls: list[_WekaCall] = []
    _flatten(record["requests"], 0.0, where, calls)
    calls.sort(key=lambda c: c.t)
    return calls


def _flatten(entries: list[object], base_t: float, where: str, out: list[_WekaCall]) -> None:
    """Model calls of a request list, sub-agents' calls shifted by their start time (recursively)."""
    for k, entry in enumerate(entries):
        at = f"{where}: request {k}"
        if not isinstance(entry, dict):
            raise TraceError(f"{at}: expected an object")
        t = entry.get("t")
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < math.inf:
            raise TraceError(f"{at}: field 't' must be a number of seconds >= 0, got {t!r}")
        if entry.get("type") == "subagent":
            nested = entry.get("requests")
            if not isinstance(nested, list):
                raise TraceError(f"{at}: sub-agent without a 'requests' list")
            _flatten(nested, base_t + float(t), f"{at} (sub-agent)", out)
            continue
        tokens = _int_field(entry, "in", 1, at)
        hash_ids = entry.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
        ):
            raise TraceError(f"{at}: field 'hash_ids' must be a list of integers")
        if len(hash_ids) != tokens // WEKA_BLOCK_TOKENS:
            raise TraceError(
                f"{at}: {len(hash_ids)} hash_ids for in={tokens}; "
                f"expected {tokens} // {WEKA_BLOCK_TOKENS} = {tokens // WEKA_BLOCK_TOKENS}"
            )
        out.append(
            _WekaCall(base_t + float(t), tokens, max(1, _int_field(entry, "out", 0, at)), tuple(hash_ids))
        )


class _Chainer:
    """Interns 512-token block ids: (conversation, previous block id, its 64-token ids, tokens) -> id."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int, tuple[int, ...], int], int] = {}
        self._next = 0

    def _fresh(self) -> int:
        self._next += 1
        return self._next - 1

    def chain(self, conv: int, call: _WekaCall) -> tuple[tuple[int, ...], tuple[int, ...]]:
        sizes = block_token_counts(call.input_tokens, math.ceil(call.input_tokens / TRACE_BLOCK_TOKENS))
        ids: list[int] = []
        parent = -1
        for i, tokens in enumerate(sizes):
            group = call.hash_ids[i * WEKA_GROUP : (i + 1) * WEKA_GROUP]
            if len(group) * WEKA_BLOCK_TOKENS < tokens:  # holds unhashed tail tokens: never shared
                parent = self._fresh()
            else:
                key = (conv, parent, group, tokens)
                found = self._ids.get(key)
                if found is None:
                    found = self._ids[key] = self._fresh()
                parent = found
            ids.append(parent)
        return tuple(ids), sizes
