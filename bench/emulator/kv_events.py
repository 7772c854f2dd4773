"""vLLM-format KV-cache events of the emulated worker, published on a ZMQ PUB socket.

Wire format (shared/reference/PEERS.md §3.2-3.3, vLLM's array encoding): each message is three
frames `[topic, seq (8-byte big-endian, from 0), msgpack([ts, [events...], dp_rank])]` with events
  ["BlockStored", block_hashes, parent_block_hash | None, token_ids, block_size, lora_id, "GPU",
   lora_name, extra_keys]   (extra_keys one entry per block, as vLLM: (lora_name?, cache_salt?) for
                             block 0, (lora_name,) after it, None when there are none)
  ["BlockRemoved", block_hashes, "GPU"]
  ["AllBlocksCleared"]
Block hashes are the emulator's 64-bit block keys (bench/emulator/tokenizer.py). The engine reports
only keys, so `BlockCatalog` remembers each full block's parent and tokens from the moment a request
submits it; keys the catalog does not know (a request's trailing partial block, which vLLM never
caches) are not published.
Unlike vLLM, which connects unless the endpoint has a wildcard, the publisher always BINDs: the agent
next to the worker connects its SUB socket. The topic defaults to llm-d's `kv@<worker-id>@<model>`.
A replay socket as vLLM's (`replay_endpoint`): a ROUTER bound beside the PUB; a DEALER (or REQ) sends
`[b"", start_seq (8 bytes big-endian)]` and gets back every buffered batch from `start_seq` on as
`[b"", seq, payload]`, then `[b"", END_SEQ (-1 as 8 signed bytes), b""]`. The buffer holds the last
`buffer_steps` batches published, dropped ones included (a drop is a loss on the wire).
Faults on command (`POST /kvgate/kv_faults {"drop": n, "duplicate": n, "reorder": n}`):
the next n batches are lost (their sequence numbers used up), sent twice, or each held back and sent
after the batch that follows it, so the agent's resync can be tested end to end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio
from cachetools import LRUCache

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
# ("stored" | "removed" | "cleared", keys), from Engine.drain_kv_events
EngineKvEvent = tuple[str, Sequence[Hashable]]


@dataclass(frozen=True, slots=True)
class CatalogBlock:
    parent: int | None
    tokens: tuple[int, ...]
    lora_name: str | None = None
    extra_keys: tuple[str, ...] | None = None  # vLLM's per-block extra keys (LoRA name, cache salt)


class BlockCatalog:
    """Parent key, token ids and extra keys of every full block submitted recently (bounded LRU)."""

    def __init__(self, max_blocks: int) -> None:
        self._blocks: LRUCache[Hashable, CatalogBlock] = LRUCache(maxsize=max_blocks)

    def remember(
        self,
        keys: Sequence[int],
        tokens: Sequence[int],
        block_size: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """`keys` are the chained keys of the full blocks of `tokens`, block 0 first."""
        parent: int | None = None
        for i, key in enumerate(keys):
            extra = (lora_name,) if lora_name is not None else ()
            if i == 0 and cache_salt is not None:  # vLLM salts block 0 only; the chain carries it on
                extra += (cache_salt,)
            block = tuple(tokens[i * block_size : (i + 1) * block_size])
            self._blocks[key] = CatalogBlock(parent, block, lora_name, extra or None)
            parent = key

    def get(self, key: Hashable) -> CatalogBlock | None:
        return self._blocks.get(key)

    def forget(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._blocks.pop(key, None)

    def __len__(self) -> int:
        return len(self._blocks)


def to_vllm_events(
    engine_events: Iterable[EngineKvEvent], catalog: BlockCatalog, block_size: int
) -> list[list[Any]]:
    """vLLM array-encoded events for the engine's events, in order.

    Consecutive stored keys that chain (each the child of the previous) share one BlockStored, as
    vLLM reports the blocks of one request's step.
    """
    out: list[list[Any]] = []
    for kind, keys in engine_events:
        if kind == "stored":
            out += _stored_runs(keys, catalog, block_size)
        elif kind == "removed":
            known = [k for k in keys if catalog.get(k) is not None]
            if known:
                out.append(["BlockRemoved", known, MEDIUM])
        elif kind == "cleared":
            out.append(["AllBlocksCleared"])
        else:
            raise ValueError(f"unknown engine KV event {kind!r}")
    return out


def _stored_runs(keys: Sequence[Hashable], catalog: BlockCatalog, block_size: int) -> list[list[Any]]:
    events: list[list[Any]] = []
    run: list[Hashable] = []
    tokens: list[int] = []
    extras: list[Any] = []
    run_parent: int | None = None
    lora: str | None = None

    def stored() -> list[Any]:
        extra_keys = list(extras) if any(e is not None for e in extras) else None
        return ["BlockStored", run, run_parent, tokens, block_size, None, MEDIUM, lora, extra_keys]

    for key in keys:
        entry = catalog.get(key)
        if entry is None:
            continue
        if run and entry.parent != run[-1]:
            events.append(stored())
            run, tokens, extras = [], [], []
        if not run:
            run_parent, lora = entry.parent, entry.lora_name
        run.append(key)
        tokens.extend(entry.tokens)
        extras.append(list(entry.extra_keys) if entry.extra_keys is not None else None)
    if run:
        events.append(stored())
    return events


def encode_batch(ts: float, events: Sequence[Sequence[Any]], dp_rank: int | None = 0) -> bytes:
    """The third frame: vLLM's array-encoded EventBatch."""
    payload: bytes = msgpack.packb([ts, list(events), dp_rank], use_bin_type=True)
    return payload


def default_topic(worker_id: str, model: str) -> str:
    return f"kv@{worker_id}@{model}"


END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
BUFFER_STEPS = 10_000  # vLLM's default KVEventsConfig.buffer_steps


class KvEventPublisher:
    """A bound ZMQ PUB socket sending one batch per call to `publish()`, and the optional replay socket."""

    def __init__(
        self, endpoint: str, topic: str, replay_endpoint: str | None = None, buffer_steps: int = BUFFER_STEPS
    ) -> None:
        self.topic = topic.encode()
        self._seq = 0
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
        self._replay: zmq.asyncio.Socket | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self.replays_served = 0
        try:
            self._socket.bind(endpoint)
            if replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"cannot bind KV-event endpoint {endpoint} / {replay_endpoint}: {e}") from e
        # the actual endpoints, with the port filled in when one asked for "tcp://host:*"
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        )
        self.faults = {"drop": 0, "duplicate": 0, "reorder": 0}  # batches still to treat so
        self._held: list[list[bytes]] | None = None  # a reordered batch, sent after the next one

    async def publish(self, events: Sequence[Sequence[Any]], ts: float | None = None) -> None:
        if not events:
            return
        payload = encode_batch(time.time() if ts is None else ts, events)
        frames = [self.topic, self._seq.to_bytes(8, "big"), payload]
        self._buffer.append((self._seq, payload))
        self._seq += 1
        if self.faults["drop"] > 0:
            self.faults["drop"] -= 1
            logger.info("KV-event batch %d dropped on command", self._seq - 1)
            return
        if self.faults["reorder"] > 0 and self._held is None:
            self.faults["reorder"] -= 1
            self._held = frames
            return
        copies = 1
        if self.faults["duplicate"] > 0:
            self.faults["duplicate"] -= 1
            copies = 2
        out = [frames] * copies
        if self._held is not None:
            out.append(self._held)
            self._held = None
        for message in out:
            try:
                await self._socket.send_multipart(message, flags=zmq.NOBLOCK)
            except zmq.Again:  # a PUB socket drops at its high-water mark; so do we, and say so
                logger.warning("KV-event batch dropped (high-water mark)")

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (vLLM's `_service_replay`); a no-op without the socket."""
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("invalid KV-event replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await self._replay.send_multipart([client, b"", END_SEQ, b""])
            self.replays_served += 1
            await asyncio.sleep(0)

    @property
    def batches_sent(self) -> int:
        return self._seq

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()
