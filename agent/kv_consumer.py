"""Exact mode, imperative shell: subscribe to a worker's KV-event publisher and write index changes.

A ZMQ SUB socket (pyzmq asyncio) connects to the worker's publisher (vLLM binds `tcp://*:port`);
each `[topic, seq, payload]` message is decoded (agent/kv_events.py), sequence gaps are logged and
counted, and the implied adds/removes go to the Redis index store (store/index_store.py), runs of the
same op coalesced into one call. AllBlocksCleared, or a sequence that goes back (the publisher
restarted), clears the worker's entries and calls `on_reset` (the agent bumps the epoch).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from redis.exceptions import RedisError

from agent.kv_events import KvEvent, KvEventDecodeError, RouterKeys, decode_batch
from store import index_store

logger = logging.getLogger(__name__)

LATE_WINDOW = 64  # a batch at most this far behind the last one is reordered, not a restarted publisher


@dataclass
class KvEventStats:
    batches: int = 0
    events: int = 0
    decode_errors: int = 0
    write_errors: int = 0
    seq_gaps: int = 0
    missed_batches: int = 0
    clears: int = 0
    duplicates: int = 0  # batches received twice (skipped)
    late: int = 0  # batches older than one already applied (skipped: the gap before it reset the index)
    last_seq: dict[bytes, int] = field(default_factory=dict)

    def observe_seq(self, topic: bytes, seq: int) -> str | None:
        """Record a batch's sequence number; None when it is the next one, else "gap" (batches lost),
        "duplicate" (this one again), "late" (an older one, out of order) or "reset" (the publisher
        restarted: back to 0, or further back than a reorder can explain)."""
        previous = self.last_seq.get(topic)
        if previous is None or seq == previous + 1:
            self.last_seq[topic] = seq
            return None
        if seq == previous:
            self.duplicates += 1
            return "duplicate"
        if 0 < seq < previous and previous - seq <= LATE_WINDOW:
            self.late += 1
            return "late"
        self.last_seq[topic] = seq
        if seq < previous:
            return "reset"
        self.seq_gaps += 1
        self.missed_batches += seq - previous - 1
        return "gap"


class KvEventConsumer:
    """Subscribe to one worker's KV-event publisher and keep its index entries in Redis up to date."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        endpoint: str,
        model: str,
        worker_id: str,
        router_block_size: int = 16,
        capacity_blocks: Callable[[], int] = lambda: 0,
        on_reset: Callable[[str], Awaitable[None]] | None = None,
        clock_ms: Callable[[], int],
        topic: bytes = b"",
    ) -> None:
        self.redis = redis
        self.endpoint = endpoint
        self.model = model
        self.worker_id = worker_id
        self.keys = RouterKeys(model, router_block_size)
        self.capacity_blocks = capacity_blocks
        self.on_reset = on_reset
        self.clock_ms = clock_ms
        self.topic = topic
        self.stats = KvEventStats()
        self.connected = False

    async def run(self) -> None:
        """Receive until cancelled. The SUB socket connects (vLLM's publisher binds `tcp://*:port`)."""
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            sock.connect(self.endpoint)
            self.connected = True
            logger.info("kv events: subscribed to %s", self.endpoint)
            while True:
                frames = await sock.recv_multipart()
                try:
                    await self.handle_message(frames)
                except (RedisError, OSError) as e:
                    # the index misses this batch; later removals of its blocks are no-ops
                    self.stats.write_errors += 1
                    logger.warning("kv events: index write failed: %s", e)
        finally:
            self.connected = False
            sock.close(linger=0)
            ctx.term()

    async def handle_message(self, frames: Sequence[bytes]) -> None:
        """One ZMQ message: `[topic, seq, payload]` (a 2-frame `[seq, payload]` is accepted too)."""
        if len(frames) not in (2, 3) or len(frames[-2]) != 8:
            self.stats.decode_errors += 1
            logger.warning("kv events: unexpected message with %d frames", len(frames))
            return
        topic = bytes(frames[0]) if len(frames) == 3 else b""
        seq = int.from_bytes(frames[-2], "big")
        try:
            batch = decode_batch(frames[-1])
        except KvEventDecodeError as e:
            self.stats.decode_errors += 1
            logger.warning("kv events: %s", e)
            return
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        seq_state = self.stats.observe_seq(topic, seq)
        if seq_state == "gap":
            # a lost batch may have stored or removed anything: the entries cannot be trusted, so the
            # worker's index starts again from this batch (no replay socket is asked; docs/AGENT.md)
            logger.warning("kv events: seq gap before %d on %r (%d batches missed so far): resetting "
                           "the worker's index", seq, topic, self.stats.missed_batches)  # fmt: skip
            await self._clear("kv event sequence gap")
        elif seq_state in ("duplicate", "late"):
            logger.info("kv events: %s batch %d on %r skipped", seq_state, seq, topic)
            return
        elif seq_state == "reset":
            logger.warning("kv events: seq went back to %d on %r: publisher restarted", seq, topic)
            await self._clear("kv event publisher restarted")
        await self.apply(batch.events)

    async def apply(self, events: Sequence[KvEvent]) -> None:
        """Apply events in order, coalescing runs of the same op into one Redis call."""
        run_op, run_keys = "", list[int]()
        for event in events:
            change = self.keys.apply(event)
            if change is None:
                continue
            if change.op == "clear":
                await self._flush(run_op, run_keys)
                run_op, run_keys = "", []
                await self._clear("AllBlocksCleared")
                continue
            if change.op != run_op:
                await self._flush(run_op, run_keys)
                run_op, run_keys = change.op, []
            run_keys += change.keys
        await self._flush(run_op, run_keys)

    async def _flush(self, op: str, keys: list[int]) -> None:
        if not keys:
            return
        if op == "add":
            await index_store.add_blocks(
                self.redis, self.model, self.worker_id, keys, self.clock_ms(), self.capacity_blocks()
            )
        elif op == "remove":
            await index_store.remove_blocks(self.redis, self.model, self.worker_id, keys)

    async def _clear(self, reason: str) -> None:
        self.stats.clears += 1
        self.keys.reset()
        await index_store.clear_worker(self.redis, self.model, self.worker_id)
        if self.on_reset is not None:
            await self.on_reset(reason)
