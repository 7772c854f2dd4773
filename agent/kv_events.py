"""Exact-mode cache summary: the worker's vLLM KV events (ZMQ) turned into prefix-index entries.

The worker publishes 3-frame messages `[topic, seq (8-byte big-endian), msgpack(batch)]`
(shared/reference/PEERS.md §3.2-3.3). `decode_batch` accepts both wire encodings: events as arrays
(`["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, ...]`, vLLM <= 0.23)
or as maps with a `"type"` key (vLLM >= 0.26, SGLang); trailing defaulted fields may be missing.

Engine block hashes are only opaque ids here (PEERS §3.5: don't reproduce engine hashes). `RouterKeys`
re-hashes each stored block's token ids with the gateway's own chained hash
(`policy.prefix.token_block_hashes`, seeded by the model name, router block size), remembering for
each engine hash the chain state after it, so a child block continues from its parent's router key and
a removal drops exactly the router keys that block produced. The map is an LRU bounded by the worker's
block count. Blocks whose parent the agent never saw (stored before it started) are skipped: their
keys cannot be computed. Only GPU blocks (medium GPU or unset) count.

The ZMQ subscriber that applies these to Redis is `agent/kv_consumer.py`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import msgpack  # type: ignore[import-untyped]
from cachetools import LRUCache

from policy.prefix import chain_namespace, chain_seed, token_block_hashes

U64 = (1 << 64) - 1
_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


class KvEventDecodeError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One decoded event; `kind` is BlockStored, BlockRemoved, AllBlocksCleared (or an unknown tag)."""

    kind: str
    block_hashes: tuple[int, ...] = ()
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[object, ...] | None, ...] = ()  # one entry per block (vLLM), or none


@dataclass(frozen=True, slots=True)
class KvBatch:
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None


def engine_hash(value: Any) -> int | None:
    """Engine block hash as a 64-bit int: ints masked, bytes by their last 8 bytes big-endian."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(bytes(value[-8:]), "big")
    if isinstance(value, int):
        return value & U64
    raise KvEventDecodeError(f"block hash must be int or bytes, not {type(value).__name__}")


def _event(raw: Any) -> KvEvent:
    if isinstance(raw, dict):
        fields = {str(k): v for k, v in raw.items()}
        kind = str(fields.pop("type", ""))
    elif isinstance(raw, list | tuple) and raw:
        kind = str(raw[0])
        fields = dict(zip(_FIELDS.get(kind, ()), raw[1:], strict=False))
    else:
        raise KvEventDecodeError(f"event must be an array or a map, not {raw!r:.80}")
    hashes = tuple(h for h in (engine_hash(x) for x in fields.get("block_hashes") or ()) if h is not None)
    medium = fields.get("medium")
    lora_id, lora_name = fields.get("lora_id"), fields.get("lora_name")
    extra = fields.get("extra_keys") or ()
    if not isinstance(extra, list | tuple):
        raise KvEventDecodeError(f"extra_keys must be a list, not {extra!r:.80}")
    extra_keys = tuple(tuple(e) if isinstance(e, list | tuple) else None for e in extra)
    return KvEvent(
        kind=kind,
        block_hashes=hashes,
        parent_block_hash=engine_hash(fields.get("parent_block_hash")),
        token_ids=tuple(int(t) for t in fields.get("token_ids") or ()),
        block_size=int(fields.get("block_size") or 0),
        medium=str(medium) if medium is not None else None,
        lora_id=int(lora_id) if isinstance(lora_id, int) and lora_id > 0 else None,
        lora_name=str(lora_name) if lora_name else None,
        extra_keys=extra_keys if any(e for e in extra_keys) else (),
    )


def decode_batch(payload: bytes) -> KvBatch:
    """The msgpack third frame of a KV-event message, in either encoding, at batch and event level."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise KvEventDecodeError(f"not a msgpack batch: {e}") from e
    if isinstance(raw, dict):
        ts, events, dp_rank = raw.get("ts", 0.0), raw.get("events") or [], raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events, dp_rank = raw[0], raw[1] or [], raw[2] if len(raw) > 2 else None
    else:
        raise KvEventDecodeError(f"batch must be [ts, events, dp_rank] or a map, not {raw!r:.80}")
    return KvBatch(ts=float(ts or 0.0), events=tuple(_event(e) for e in events), dp_rank=dp_rank)


def continue_chain(parent: int | None, token_ids: Sequence[int], *, model: str, block_size: int) -> list[int]:
    """Router keys of the full blocks of `token_ids` following the router key `parent` (None = start).

    Same chain as `policy.prefix.token_block_hashes`: key_i = blake2b(key_{i-1} (8 bytes LE) ‖ block_i
    as little-endian u32), so continuing from a parent equals hashing the whole prefix at once.
    """
    if parent is None:
        return list(token_block_hashes(token_ids, model=model, block_size=block_size)[0])
    prev = parent.to_bytes(8, "little")
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - 'I' is 4 bytes on every platform we run on
        raise RuntimeError("array('I') is not 32-bit here")
    data = packed.tobytes()
    step = 4 * block_size
    keys = []
    for i in range(len(token_ids) // block_size):
        prev = blake2b(prev + data[i * step : (i + 1) * step], digest_size=8).digest()
        keys.append(int.from_bytes(prev, "little"))
    return keys


@dataclass(frozen=True, slots=True)
class _ChainState:
    last_key: int | None  # router key of the last full router block so far (None = none yet)
    pending: tuple[int, ...]  # tokens after it that do not fill a router block yet
    keys: tuple[int, ...]  # router keys this engine block completed (removed with it)
    model: str | None = None  # the index these keys go to (a LoRA adapter's); None = the worker's model


@dataclass(frozen=True, slots=True)
class IndexChange:
    op: str  # "add" | "remove" | "clear"
    keys: tuple[int, ...] = ()
    model: str | None = None  # the index it changes (a LoRA adapter the worker serves); None = the model
    more: tuple[IndexChange, ...] = ()  # a removal's keys in other models' indexes


class RouterKeys:
    """Engine hash -> router keys, so KV events become index adds and removes (bounded LRU)."""

    def __init__(
        self,
        model: str,
        router_block_size: int,
        max_blocks: int = 1 << 18,
        adapters: frozenset[str] = frozenset(),
    ) -> None:
        if router_block_size <= 0:
            raise ValueError("router_block_size must be > 0")
        self.model = model
        self.adapters = adapters  # LoRA adapters the worker serves under their own names (own indexes)
        self.block_size = router_block_size
        self._chains: LRUCache[int, _ChainState] = LRUCache(maxsize=max(1, max_blocks))
        self.unknown_parents = 0  # stored blocks skipped because their parent was never seen

    def __len__(self) -> int:
        return len(self._chains)

    def reset(self) -> None:
        """Forget every chain (the worker's cache was cleared or its publisher restarted)."""
        self._chains.clear()

    def apply(self, event: KvEvent) -> IndexChange | None:
        """The index change an event implies (None if it implies none)."""
        if event.kind == "AllBlocksCleared":
            self.reset()
            return IndexChange("clear")
        if event.medium is not None and event.medium.upper() != "GPU":
            return None
        if event.kind == "BlockRemoved":
            removed: dict[str | None, list[int]] = {}
            for h in event.block_hashes:
                state = self._chains.pop(h, None)
                if state is not None:
                    removed.setdefault(state.model, []).extend(state.keys)
            if not removed:
                return None
            (model, keys), *others = removed.items()
            more = tuple(IndexChange("remove", tuple(k), m) for m, k in others)
            return IndexChange("remove", tuple(keys), model, more)
        if event.kind == "BlockStored":
            return self._stored(event)
        return None

    def _stored(self, event: KvEvent) -> IndexChange | None:
        if not event.token_ids or not event.block_hashes:
            return None  # empty token list: an offload notice for blocks already known
        if event.parent_block_hash is None:
            state = self._root(event)
        elif (parent := self._chains.get(event.parent_block_hash)) is not None:
            state = parent
        else:
            self.unknown_parents += 1
            return None
        engine_size = event.block_size or len(event.token_ids) // len(event.block_hashes)
        added: list[int] = []
        for i, h in enumerate(event.block_hashes):
            last = state.last_key
            if i or event.parent_block_hash is not None:
                # a later block's own extra keys (multimodal hashes) make every key from here on differ
                # from a text-only prefix's; the adapter's name is in the seed already
                extra = self._extra(event, i)
                if extra and last is not None:
                    last = chain_seed(chain_namespace(f"{last:016x}", extra))
            tokens = state.pending + event.token_ids[i * engine_size : (i + 1) * engine_size]
            keys = continue_chain(last, tokens, model=self.model, block_size=self.block_size)
            used = len(keys) * self.block_size
            state = _ChainState(keys[-1] if keys else last, tokens[used:], tuple(keys), state.model)
            self._chains[h] = state
            added += keys
        return IndexChange("add", tuple(added), state.model) if added else None

    def _extra(self, event: KvEvent, i: int) -> tuple[object, ...]:
        """Block i's extra keys other than the LoRA adapter's name."""
        if i >= len(event.extra_keys) or event.extra_keys[i] is None:
            return ()
        return tuple(k for k in event.extra_keys[i] or () if k != event.lora_name)

    def _root(self, event: KvEvent) -> _ChainState:
        """The chain state before block 0: seeded by the adapter (or model) name and block 0's salt."""
        name = event.lora_name or (f"{self.model}\x00lora-{event.lora_id}" if event.lora_id else self.model)
        model = event.lora_name if event.lora_name in self.adapters else None
        return _ChainState(chain_seed(chain_namespace(name, self._extra(event, 0))), (), (), model)
