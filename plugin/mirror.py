"""The gateway's in-process copy of the worker registry and of the shared prefix index.

Routing reads only this mirror, so a routing decision costs no Redis round trip (DESIGN.md hot
path). Two kinds of background task keep it fresh:
  * a refresh loop reads every model's registry (`store.registry.read_workers`, one round trip per
    model) every `refresh_ms`;
  * per model, an index tail loads a snapshot of the prefix index once, then follows its log stream
    (`store.index_store.tail`, blocking XREAD) and hands each batch of ops to `on_index_ops`.
A worker whose epoch changed (restart, cache reset) or that left is reported through
`on_worker_reset` so its index entries are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from runtime.tasks import cancel_and_wait, spawn
from store import index_store, reconnect, registry
from store.registry import WorkerRecord

logger = logging.getLogger(__name__)

IndexOpsCallback = Callable[[str, Sequence[index_store.IndexOp]], None]
WorkerResetCallback = Callable[[str, str], None]


def wall_ms() -> int:
    return int(time.time() * 1000)


class ClusterMirror:
    """Workers per model and the prefix-index feed, refreshed in the background."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        refresh_ms: int = 500,
        on_index_ops: IndexOpsCallback | None = None,
        on_worker_reset: WorkerResetCallback | None = None,
        tail_index: bool = True,
        tail_block_ms: int = 1000,
        on_refresh: Callable[[Sequence[str]], None] | None = None,
    ) -> None:
        self.on_refresh = on_refresh
        self.redis = redis
        self.refresh_ms = refresh_ms
        self.on_index_ops = on_index_ops
        self.on_worker_reset = on_worker_reset
        self.tail_index = tail_index
        self.tail_block_ms = tail_block_ms
        self._workers: dict[str, list[WorkerRecord]] = {}
        self._epochs: dict[tuple[str, str], int] = {}
        self._tails: dict[str, asyncio.Task[None]] = {}
        self._refresher: asyncio.Task[None] | None = None
        self.last_refresh_ok = False
        self.refreshed = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.refresh()
        self._refresher = spawn(self._refresh_loop(), name="kvgate-mirror-refresh")

    async def close(self) -> None:
        await cancel_and_wait(self._refresher, *self._tails.values())
        self._tails.clear()

    # -- reads (hot path: no I/O) --------------------------------------------------------------------
    def models(self) -> list[str]:
        return sorted(m for m, ws in self._workers.items() if ws)

    def workers(self, model: str) -> list[WorkerRecord]:
        """Every registered worker of `model`, including expired and draining ones."""
        return self._workers.get(model, [])

    def routable(self, model: str, now_ms: int | None = None) -> list[WorkerRecord]:
        """Workers of `model` whose lease is valid now and that are not draining."""
        now = wall_ms() if now_ms is None else now_ms
        return [w for w in self._workers.get(model, ()) if w.lease_expiry_ms > now and not w.draining]

    def served_models(self, now_ms: int | None = None) -> list[str]:
        """Union of the models served by routable workers (GET /v1/models)."""
        now = wall_ms() if now_ms is None else now_ms
        return sorted(
            {m for ws in self._workers.values() for w in ws if w.lease_expiry_ms > now and not w.draining
             for m in w.models}
        )  # fmt: skip

    # -- background ----------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read every model's registry once (one round trip per model, plus one for the model list)."""
        now = wall_ms()
        models = await registry.list_models(self.redis)
        fresh: dict[str, list[WorkerRecord]] = {}
        for model in models:
            fresh[model] = await registry.read_workers(self.redis, model, now)
        self._detect_resets(fresh)
        self._workers = fresh
        self.last_refresh_ok = True
        self.refreshed.set()
        if self.on_refresh is not None:
            self.on_refresh(models)
        if self.tail_index:
            for model in models:
                if model not in self._tails:
                    self._tails[model] = spawn(self._tail_loop(model), name=f"kvgate-index-tail-{model}")

    def _detect_resets(self, fresh: dict[str, list[WorkerRecord]]) -> None:
        seen: set[tuple[str, str]] = set()
        for model, records in fresh.items():
            for record in records:
                key = (model, record.id)
                seen.add(key)
                old = self._epochs.get(key)
                if old is not None and old != record.epoch and self.on_worker_reset:
                    self.on_worker_reset(model, record.id)
                self._epochs[key] = record.epoch
        for key in set(self._epochs) - seen:
            del self._epochs[key]
            if self.on_worker_reset:
                self.on_worker_reset(*key)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_ms / 1000)
            try:
                await self.refresh()
            except (RedisError, OSError) as e:
                if self.last_refresh_ok:
                    logger.warning("worker registry refresh failed: %s", e)
                self.last_refresh_ok = False

    async def _tail_loop(self, model: str) -> None:
        cursor: str | None = None
        failures = 0  # consecutive, for the backoff before reloading
        while True:
            try:
                if cursor is None:
                    cursor, snapshot = await index_store.load_snapshot_with_cursor(self.redis, model)
                    ops = [
                        index_store.IndexOp(
                            "add", worker, tuple(hashes)
                        )  # most recent first, as insert wants
                        for worker, hashes in snapshot.items()
                    ]
                else:
                    cursor, ops = await index_store.tail(
                        self.redis, model, cursor, block_ms=self.tail_block_ms
                    )
                if ops and self.on_index_ops:
                    self.on_index_ops(model, ops)
                failures = 0
            except (RedisError, OSError) as e:
                logger.warning("prefix index tail of %s failed: %s; reloading", model, e)
                cursor = None
                failures += 1
                await asyncio.sleep(reconnect.delay_s(failures))
