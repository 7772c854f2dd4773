"""Exact mode, imperative shell: subscribe to a worker's KV-event publisher and write index changes.

A ZMQ SUB socket (pyzmq asyncio) per data-parallel rank connects to the worker's publisher (vLLM binds
`tcp://*:port`, rank r at port + r: `rank_endpoint`); each `[topic, seq, payload]` message is decoded
(agent/kv_events.py) and the implied adds/removes go to the Redis index store (store/index_store.py),
runs of the same op coalesced into one call.

A sequence gap (batches lost) is resynced through the worker's replay socket when it has one (vLLM's
`replay_endpoint`: a DEALER asks for the missing sequence numbers and applies them in order before the
batch that showed the gap); when there is none, or the replay cannot supply every missing batch in
time, that rank's entries are dropped and it starts again from this batch (`on_reset` bumps the epoch).
A loss at the tail (no later batch shows the gap) is caught by asking the replay socket for what follows
the last batch seen whenever the publisher has been quiet for `idle_probe_s` (the agent passes half its
heartbeat period), so the index is whole again within about one heartbeat (`kvgate bench gaps`).
AllBlocksCleared, or a sequence that goes back (the publisher restarted), drops the rank's entries too.
With several ranks the worker's index is their union: a key leaves Redis when no rank holds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from redis.exceptions import RedisError

from agent.kv_events import KvEvent, KvEventDecodeError, RouterKeys, decode_batch
from store import index_store

logger = logging.getLogger(__name__)

LATE_WINDOW = 64  # a batch at most this far behind the last one is reordered, not a restarted publisher
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
REPLAY_TIMEOUT_S = 0.5  # a replay slower than this counts as failed: the rank's entries are reset


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's `offset_endpoint_port`: data-parallel rank r publishes at the base port + r (tcp) or
    with a `_dp<r>` suffix (ipc, inproc)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"cannot offset KV-event endpoint {endpoint!r} by DP rank")
    return f"{base}:{int(port) + rank}"


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
    replays: int = 0  # gaps filled from the replay socket
    replay_failures: int = 0  # gaps the replay could not fill (the rank's entries were reset instead)
    tail_probes_found: int = 0  # idle probes of the replay socket that found lost tail batches
    last_recovery_s: float = 0.0  # time from seeing the last gap to the index being whole again
    last_seq: dict[object, int] = field(default_factory=dict)

    def observe_seq(self, topic: object, seq: int) -> str | None:
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


class _Rank:
    """What the consumer keeps per data-parallel rank: its endpoints and its engine-hash chains."""

    def __init__(self, rank: int, endpoint: str, replay: str | None, keys: RouterKeys) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self.replay = replay
        self.keys = keys


class KvEventConsumer:
    """Subscribe to one worker's KV-event publisher(s) and keep its index entries in Redis up to date."""

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
        replay_endpoint: str | None = None,
        dp_size: int = 1,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        adapters: Sequence[str] = (),
        idle_probe_s: float | None = None,
    ) -> None:
        if dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        self.redis = redis
        self.endpoint = endpoint
        self.model = model
        self.worker_id = worker_id
        # LoRA adapters the worker serves under their own names: their blocks go to their own indexes
        self.adapters = frozenset(adapters) - {model}
        self.ranks = [
            _Rank(
                r,
                rank_endpoint(endpoint, r),
                rank_endpoint(replay_endpoint, r) if replay_endpoint else None,
                RouterKeys(model, router_block_size, adapters=self.adapters),
            )
            for r in range(dp_size)
        ]
        self.keys = self.ranks[0].keys
        self.capacity_blocks = capacity_blocks
        self.on_reset = on_reset
        self.clock_ms = clock_ms
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.idle_probe_s = idle_probe_s  # quiet this long: ask the replay socket for lost tail batches
        self.stats = KvEventStats()
        self.connected = False
        # several ranks: router key -> ranks holding it (the worker's entry is their union)
        self._holders: dict[tuple[str, int], set[int]] | None = {} if dp_size > 1 else None
        self._ctx: zmq.asyncio.Context | None = None

    async def run(self) -> None:
        """Receive until cancelled. The SUB sockets connect (vLLM's publisher binds `tcp://*:port`)."""
        self._ctx = ctx = zmq.asyncio.Context()
        socks: list[zmq.asyncio.Socket] = []
        try:
            for rank in self.ranks:
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, self.topic)
                sock.connect(rank.endpoint)
                socks.append(sock)
                logger.info("kv events: subscribed to %s (DP rank %d)", rank.endpoint, rank.rank)
            self.connected = True
            poller = zmq.asyncio.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            probe_ms = int(1000 * self.idle_probe_s) if self.idle_probe_s else None
            can_probe = probe_ms is not None and any(r.replay for r in self.ranks)
            while True:
                ready = dict(await poller.poll(probe_ms if can_probe else None))
                if not ready:
                    try:
                        await self.probe_tail()
                    except (RedisError, OSError) as e:
                        self.stats.write_errors += 1
                        logger.warning("kv events: index write failed: %s", e)
                    continue
                for i, sock in enumerate(socks):
                    if sock not in ready:
                        continue
                    frames = await sock.recv_multipart()
                    try:
                        await self.handle_message(frames, rank=i)
                    except (RedisError, OSError) as e:
                        # the index misses this batch; later removals of its blocks are no-ops
                        self.stats.write_errors += 1
                        logger.warning("kv events: index write failed: %s", e)
        finally:
            self.connected = False
            for sock in socks:
                sock.close(linger=0)
            self._ctx = None
            ctx.term()

    def forget(self) -> None:
        """The agent saw its worker restart: the new process's publisher numbers its batches from 0 again,
        and nothing it held is cached any more. Drop every rank's chains, holders and last sequence
        number, so the next batch counts as the first. (Keeping the old last number would skip the new
        publisher's batches as "late" while they trail it by at most LATE_WINDOW.)"""
        for rank in self.ranks:
            rank.keys.reset()
        if self._holders is not None:
            self._holders.clear()
        self.stats.last_seq.clear()

    async def handle_message(self, frames: Sequence[bytes], rank: int = 0) -> None:
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
        previous = self.stats.last_seq.get((rank, topic))
        seq_state = self.stats.observe_seq((rank, topic), seq)
        state = self.ranks[rank]
        if seq_state == "gap" and previous is not None:
            started = time.perf_counter()
            if await self._resync(state, previous + 1, seq):
                self.stats.replays += 1
                logger.info("kv events: gap %d..%d on rank %d replayed", previous + 1, seq - 1, rank)
            else:
                # a lost batch may have stored or removed anything: the entries cannot be trusted, so the
                # rank's index starts again from this batch
                missed = self.stats.missed_batches
                logger.warning("kv events: seq gap before %d on %r rank %d (%d batches missed so far): "
                               "resetting its index", seq, topic, rank, missed)  # fmt: skip
                await self._clear(state, "kv event sequence gap")
            await self.apply(batch.events, rank)
            self.stats.last_recovery_s = time.perf_counter() - started
            return
        if seq_state in ("duplicate", "late"):
            logger.info("kv events: %s batch %d on %r skipped", seq_state, seq, topic)
            return
        if seq_state == "reset":
            logger.warning("kv events: seq went back to %d on %r: publisher restarted", seq, topic)
            await self._clear(state, "kv event publisher restarted")
        await self.apply(batch.events, rank)

    async def probe_tail(self) -> int:
        """Ask each rank's replay socket for batches after the last one seen (a loss no later batch has
        shown yet) and handle them in order; returns how many came back."""
        found = 0
        for key, last in list(self.stats.last_seq.items()):
            rank_no, topic = cast(tuple[int, bytes], key)  # handle_message's (rank, topic)
            rank = self.ranks[rank_no]
            if rank.replay is None:
                continue
            got = await self._fetch(rank, last + 1, None)
            if got:
                self.stats.tail_probes_found += 1
                logger.info("kv events: %d batch(es) after %d on rank %d came from the replay socket",
                            len(got), last, rank_no)  # fmt: skip
            for seq in sorted(got):
                if seq > self.stats.last_seq.get((rank_no, topic), -1):
                    await self.handle_message([topic, seq.to_bytes(8, "big"), got[seq]], rank=rank_no)
                    found += 1
        return found

    async def _fetch(self, rank: _Rank, first: int, end: int | None) -> dict[int, bytes]:
        """Batches first..end-1 (end None: all from `first`) the rank's replay socket still buffers."""
        assert rank.replay is not None
        ctx = self._ctx or zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        got: dict[int, bytes] = {}
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(rank.replay)
            await sock.send_multipart([b"", first.to_bytes(8, "big")])
            deadline = asyncio.get_running_loop().time() + self.replay_timeout_s
            while True:
                left_ms = int(1000 * (deadline - asyncio.get_running_loop().time()))
                if left_ms <= 0 or not await sock.poll(left_ms):
                    logger.warning("kv events: replay from %s timed out", rank.replay)
                    break
                frames = await sock.recv_multipart()
                if len(frames) < 3 or len(frames[-2]) != 8:
                    continue
                if frames[-2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[-2], "big")
                if first <= seq and (end is None or seq < end):
                    got[seq] = bytes(frames[-1])
        finally:
            sock.close(linger=0)
        return got

    async def _resync(self, rank: _Rank, first: int, end: int) -> bool:
        """Fetch and apply batches first..end-1 from the rank's replay socket; False if it has none, or
        the replay misses one of them or takes longer than `replay_timeout_s`."""
        if rank.replay is None:
            return False
        got = await self._fetch(rank, first, end)
        if len(got) != end - first:
            self.stats.replay_failures += 1
            return False
        for seq in range(first, end):
            try:
                events = decode_batch(got[seq]).events
            except KvEventDecodeError as e:
                self.stats.decode_errors += 1
                self.stats.replay_failures += 1
                logger.warning("kv events: replayed batch %d: %s", seq, e)
                return False
            self.stats.events += len(events)
            await self.apply(events, rank.rank)
        return True

    async def apply(self, events: Sequence[KvEvent], rank: int = 0) -> None:
        """Apply events in order, coalescing runs of the same op (and index) into one Redis call."""
        state = self.ranks[rank]
        run: tuple[str, str | None] = ("", None)  # (op, model) of the keys gathered
        run_keys: list[int] = []
        for event in events:
            change = state.keys.apply(event)
            if change is None:
                continue
            if change.op == "clear":
                await self._flush(run, run_keys, rank)
                run, run_keys = ("", None), []
                await self._clear(state, "AllBlocksCleared")
                continue
            for part in (change, *change.more):
                if (part.op, part.model) != run:
                    await self._flush(run, run_keys, rank)
                    run, run_keys = (part.op, part.model), []
                run_keys += part.keys
        await self._flush(run, run_keys, rank)

    async def _flush(self, run: tuple[str, str | None], keys: list[int], rank: int) -> None:
        op, model = run[0], run[1] or self.model
        if not keys:
            return
        if op == "add":
            if self._holders is not None:
                for key in keys:
                    self._holders.setdefault((model, key), set()).add(rank)
            await index_store.add_blocks(
                self.redis, model, self.worker_id, keys, self.clock_ms(), self.capacity_blocks()
            )
        elif op == "remove":
            gone = self._released(model, keys, rank)
            await index_store.remove_blocks(self.redis, model, self.worker_id, gone)

    def _released(self, model: str, keys: Sequence[int], rank: int) -> list[int]:
        """Of `keys` (in `model`'s index) that `rank` no longer holds, those no rank holds any more."""
        if self._holders is None:
            return list(keys)
        gone = []
        for key in keys:
            ranks = self._holders.get((model, key))
            if ranks is None:
                continue
            ranks.discard(rank)
            if not ranks:
                del self._holders[(model, key)]
                gone.append(key)
        return gone

    async def _clear(self, rank: _Rank, reason: str) -> None:
        self.stats.clears += 1
        rank.keys.reset()
        if self._holders is None:
            for model in (self.model, *sorted(self.adapters)):
                await index_store.clear_worker(self.redis, model, self.worker_id)
        else:
            held: dict[str, list[int]] = {}
            for model, key in [mk for mk, ranks in self._holders.items() if rank.rank in ranks]:
                held.setdefault(model, []).append(key)
            for model, keys in held.items():
                gone = self._released(model, keys, rank.rank)
                await index_store.remove_blocks(self.redis, model, self.worker_id, gone)
        if self.on_reset is not None:
            await self.on_reset(reason)
