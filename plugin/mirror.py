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

from policy.worker_auth import verify_worker
from runtime.tasks import Background, cancel_and_wait, every, spawn
from store import index_store, reconnect, registry
from store.registry import WorkerRecord

logger = logging.getLogger(__name__)

IndexOpsCallback = Callable[[str, Sequence[index_store.IndexOp]], None]
WorkerResetCallback = Callable[[str, str], None]


# A worker that vanished from the registry without draining first (Redis restarted empty, its key
# deleted): kept as last read, routable until its lease runs out (its agent re-registers within a
# heartbeat), then known but not routable (503 + Retry-After, not 404) up to this long after that.
FORGET_VANISHED_MS = 60_000
RECOVERY_GRACE_MS = 3000  # after a registry outage: leases that lapsed during it still count this long


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
        secret: bytes = b"",
        signature_max_age_ms: int = 60_000,
    ) -> None:
        self.on_refresh = on_refresh
        self.secret = secret  # with one, only signed workers are mirrored (policy/worker_auth.py)
        self.signature_max_age_ms = signature_max_age_ms
        self.refused: dict[tuple[str, str], str] = {}  # (model, worker id) -> why it is not routable
        self.redis = redis
        self.refresh_ms = refresh_ms
        self.on_index_ops = on_index_ops
        self.on_worker_reset = on_worker_reset
        self.tail_index = tail_index
        self.tail_block_ms = tail_block_ms
        self._workers: dict[str, list[WorkerRecord]] = {}
        self._epochs: dict[tuple[str, str], int] = {}
        self._tails: dict[str, asyncio.Task[None]] = {}
        self._refresher = Background("kvgate-mirror-refresh")
        self.last_refresh_ok = False
        self.last_ok_ms = 0  # wall time of the last successful refresh
        self.outage_start_ms = self.recovered_ms = 0  # the last gap between successful refreshes
        self.refreshed = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.refresh()
        self._refresher.start(
            every(
                self.refresh_ms / 1000,
                self.refresh,
                errors=(RedisError, OSError),
                on_error=self._refresh_failed,
                wait_first=True,
            )
        )

    async def close(self) -> None:
        await self._refresher.stop()
        await cancel_and_wait(*self._tails.values())
        self._tails.clear()

    # -- reads (hot path: no I/O) --------------------------------------------------------------------
    def models(self) -> list[str]:
        return sorted(m for m, ws in self._workers.items() if ws)

    def workers(self, model: str) -> list[WorkerRecord]:
        """Every registered worker of `model`, including expired and draining ones."""
        return self._workers.get(model, [])

    def routable(self, model: str, now_ms: int | None = None) -> list[WorkerRecord]:
        """Workers of `model` whose lease is valid now and that are not draining."""
        now = self.lease_clock(now_ms)
        return [w for w in self._workers.get(model, ()) if w.lease_expiry_ms > now and not w.draining]

    def lease_clock(self, now_ms: int | None = None) -> int:
        """The time worker leases are judged at: now while the registry reads succeed; while they fail
        (Redis down or paused), the time of the last good read plus two refresh periods: leases this
        gateway could not read are not taken for expired, so a Redis pause is not a fleet-wide death
        (a worker that really died meanwhile refuses connections and is skipped as a suspect)."""
        wall = wall_ms()
        now = wall if now_ms is None else now_ms
        if self.last_ok_ms and wall - self.last_ok_ms > 2 * self.refresh_ms:
            return min(now, self.last_ok_ms + 2 * self.refresh_ms)
        if wall < self.recovered_ms + RECOVERY_GRACE_MS:  # agents are renewing what the outage let lapse
            return min(now, self.outage_start_ms + 2 * self.refresh_ms)
        return now

    def served_models(self, now_ms: int | None = None) -> list[str]:
        """Union of the models served by routable workers (GET /v1/models)."""
        now = self.lease_clock(now_ms)
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
            records = await registry.read_workers(self.redis, model, now)
            fresh[model] = [r for r in records if self._signed(r, now)] if self.secret else records
        self._keep_vanished(fresh, now)
        self._detect_resets(fresh)
        self._workers = fresh
        self.last_refresh_ok = True
        if self.last_ok_ms and now - self.last_ok_ms > 2 * self.refresh_ms:
            self.outage_start_ms, self.recovered_ms = self.last_ok_ms, now
        self.last_ok_ms = now
        self.refreshed.set()
        if self.on_refresh is not None:
            self.on_refresh(models)
        if self.tail_index:
            for model in models:
                if model not in self._tails:
                    self._tails[model] = spawn(self._tail_loop(model), name=f"kvgate-index-tail-{model}")

    def _keep_vanished(self, fresh: dict[str, list[WorkerRecord]], now_ms: int) -> None:
        """Keep the last record of every worker missing from `fresh` that was not draining (a drained
        worker deregisters; one that vanished otherwise was lost with the registry), until
        FORGET_VANISHED_MS after its lease ran out: a known model never turns into a 404 because
        Redis lost the registry, and its workers keep serving while their agents re-register."""
        for model, old in self._workers.items():
            ids = {r.id for r in fresh.get(model, ())}
            kept = [
                r for r in old
                if r.id not in ids and not r.draining and now_ms < r.lease_expiry_ms + FORGET_VANISHED_MS
            ]  # fmt: skip
            if kept:
                fresh[model] = [*fresh.get(model, ()), *kept]

    def _signed(self, record: WorkerRecord, now_ms: int) -> bool:
        """Whether `record` is signed with the worker secret and fresh; a refusal is logged once."""
        fields = {
            "url": record.url, "max_concurrency": str(record.max_concurrency),
            "joined_ms": str(record.joined_ms), "updated_ms": str(record.updated_ms), **record.extra,
        }  # fmt: skip
        why = verify_worker(
            self.secret, record.model, record.id, fields, now_ms=now_ms, max_age_ms=self.signature_max_age_ms
        )
        key = (record.model, record.id)
        if why and self.refused.get(key) != why:
            logger.warning(
                "worker %s (%s) of %s is not routable: %s", record.id, record.url, record.model, why
            )
        if why:
            self.refused[key] = why
        else:
            self.refused.pop(key, None)
        return not why

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

    def _refresh_failed(self, e: Exception) -> None:
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
