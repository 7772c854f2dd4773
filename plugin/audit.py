"""Reconciliation: held slot leases against the requests the workers say they are running.

Leases bound the damage of a lost release (they expire), but a gateway bug, a client that bypasses
the gateway or a worker that keeps requests after their lease was dropped would still skew the
quota silently. Every `period_s` one gateway (whoever holds a Redis `SET NX PX` lock; any gateway
takes over when the holder dies) compares, per model:

    leases held       store.slots.live_leases (request ids, from every gateway)
    ids in flight     the agents' reports (store.registry.read_workers -> inflight_ids, from the
                      worker's own view of X-Request-Id, which the gateway sets to the lease's id)

A mismatch counts as drift only when it is seen in two consecutive audits: reports are up to one
heartbeat old, so a request that just started or just ended is not drift. The drift is exported as
`kvgate_slot_drift{model}` and logged as a warning past `threshold`. Workers whose lease expired
more than `prune_grace_ms` ago leave the registry (registry.prune_expired) and their prefix-index
entries are dropped (index_store.clear_worker); the slots their requests held come back when those
leases expire. A worker that does not report ids (real vLLM without /kvgate/inflight: running > 0
with no ids) disables the id comparison for its model; then drift is |leases - running requests|.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import LockError, RedisError

from plugin.metrics import GatewayMetrics
from runtime.tasks import Background, every
from store import index_store, registry
from store.registry import WorkerRecord
from store.slots import live_leases

logger = logging.getLogger(__name__)

LOCK_KEY = "kvg:audit:lock"


@dataclass(frozen=True)
class Drift:
    """One model's mismatch between leases and in-flight reports (one audit)."""

    model: str
    held_not_running: frozenset[str]  # leases no worker reports in flight
    running_not_held: frozenset[str]  # ids in flight on a worker without a lease
    count_only: int | None = None  # |leases - running| when some worker does not report ids

    @property
    def total(self) -> int:
        if self.count_only is not None:
            return self.count_only
        return len(self.held_not_running) + len(self.running_not_held)


def compare(model: str, leases: Mapping[str, Any], workers: Sequence[WorkerRecord]) -> Drift:
    """This audit's raw mismatch (live workers only: an expired worker's requests are being reclaimed)."""
    live = [w for w in workers if w.live]
    if any(w.running > 0 and not w.inflight_ids for w in live):
        running = sum(w.running for w in live)
        return Drift(model, frozenset(), frozenset(), count_only=abs(len(leases) - running))
    in_flight = {rid for w in live for rid in w.inflight_ids}
    return Drift(model, frozenset(set(leases) - in_flight), frozenset(in_flight - set(leases)))


def persistent(previous: Drift | None, current: Drift) -> Drift:
    """Mismatches present in both audits (a mismatch of one audit may be a report one heartbeat old)."""
    if previous is None:
        return Drift(current.model, frozenset(), frozenset(), 0 if current.count_only is not None else None)
    if current.count_only is not None or previous.count_only is not None:
        both = min(current.count_only or 0, previous.count_only or 0)
        return Drift(current.model, frozenset(), frozenset(), count_only=both)
    return Drift(
        current.model,
        current.held_not_running & previous.held_not_running,
        current.running_not_held & previous.running_not_held,
    )


@dataclass(eq=False)
class Auditor:
    """Background task: periodic drift audit and expired-worker cleanup, one gateway at a time."""

    redis: aioredis.Redis
    metrics: GatewayMetrics
    _: KW_ONLY
    gateway_id: str
    models: Callable[[], Iterable[str]]
    period_s: float = 5.0
    threshold: int = 1
    prune_grace_ms: int = 30_000
    lock_key: str = LOCK_KEY
    # model -> raw mismatch of the previous audit
    last: dict[str, Drift] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._loop = Background("kvgate-audit")
        # redis-py's Lock: SET NX PX to take it, a compare-and-extend script to keep it, a
        # compare-and-delete to give it up; the token is this gateway's id (operators can read who audits)
        self._lock = self.redis.lock(
            self.lock_key, timeout=max(1.0, self.period_s * 2), blocking=False, thread_local=False
        )
        self._holding = False

    async def start(self) -> None:
        # (a TimeoutError is an OSError)
        self._loop.start(
            every(self.period_s, self.audit_once, errors=(RedisError, OSError), on_error=_failed)
        )

    async def close(self) -> None:
        await self._loop.stop()
        if self._holding:
            with contextlib.suppress(LockError, RedisError, OSError):  # another gateway takes over at once
                await self._lock.release()
            self._holding = False

    async def take_lock(self) -> bool:
        """Hold (or keep holding) the audit lock for two periods."""
        if self._holding:
            try:
                await self._lock.reacquire()  # the TTL back to two periods, only if still ours
                return True
            except LockError:  # it expired (a long stall) and maybe another gateway took it
                self._holding = False
        self._holding = bool(await self._lock.acquire(token=self.gateway_id))
        return self._holding

    async def audit_once(self) -> dict[str, Drift] | None:
        """One audit of every model; None if another gateway holds the lock."""
        if not await self.take_lock():
            self.last.clear()  # another gateway audits; start afresh if we take over
            self.metrics.slot_drift.values.clear()  # its gauge is the one to read
            return None
        secs, micros = await self.redis.time()
        now_ms = int(secs) * 1000 + int(micros) // 1000
        models = set(self.models()) | set(await registry.list_models(self.redis))
        drifts: dict[str, Drift] = {}
        for model in sorted(models):
            workers = await registry.read_workers(self.redis, model, now_ms)
            current = compare(model, await live_leases(self.redis, model), workers)
            drift = drifts[model] = persistent(self.last.get(model), current)
            self.last[model] = current
            self.metrics.slot_drift.set(drift.total, model)
            if drift.total >= self.threshold and drift.total > 0:
                logger.warning(
                    "kvgate audit: %s slot drift %d (leases not running: %s; running without lease: %s)",
                    model, drift.total, _some(drift.held_not_running), _some(drift.running_not_held),
                )  # fmt: skip
            await self._reclaim(model, now_ms)
        return drifts

    async def _reclaim(self, model: str, now_ms: int) -> None:
        for worker_id in await registry.prune_expired(self.redis, model, now_ms, self.prune_grace_ms):
            dropped = await index_store.clear_worker(self.redis, model, worker_id)
            logger.warning(
                "kvgate audit: worker %s of %s expired: removed from the registry, %d index entries dropped",
                worker_id, model, dropped,
            )  # fmt: skip


def _failed(e: Exception) -> None:
    logger.debug("audit failed: %s", e)


def _some(ids: Iterable[str], limit: int = 5) -> str:
    listed = sorted(ids)
    more = f" (+{len(listed) - limit})" if len(listed) > limit else ""
    return ", ".join(listed[:limit]) + more if listed else "-"
