"""Slot leases from the global admission gate: acquire before forwarding, release exactly once after.

`SlotPool` is one gateway process's client of the admission scripts (store/scripts.py). `acquire()`
costs one EVALSHA when a seat is free. Otherwise the request waits in the global queue in Redis: the
script that frees a seat grants it to the next waiter and PUBLISHes its id; this process keeps one
pub/sub subscription and wakes the local waiter, with a slow re-check (every `recheck_every_s`) for
lost messages and for seats freed by expired leases. Held leases are renewed in one round trip per
model per `renew_every_ms`. A cancelled or timed-out waiter leaves the queue at once, and a grant that
raced the cancellation is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from policy.admission import AdmitCode, AdmitResult, CheckStatus, ClaimCode, Quota, estimated_wait_s
from policy.types import Band
from runtime.tasks import cancel_and_wait, spawn
from store import connect, reconnect
from store.scripts import (
    GRANTED_CHANNEL,
    AdmissionScripts,
    model_keys,
    quota_key,
    register_scripts,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ticket:
    """A request asking for seats."""

    request_id: str
    model: str
    band: Band
    tenant: str
    seats: int = 1
    max_wait_s: float = 30.0  # 0 = don't wait: reject at once if no seat is free


@dataclass(frozen=True)
class Lease:
    """Seats held by a running request; renewed by its SlotPool until released."""

    request_id: str
    model: str
    band: Band
    tenant: str
    seats: int
    queued_s: float  # time spent waiting for the grant
    worker: str | None = None  # the worker it is placed on (two-step admission), None = not placed


class AdmissionRejected(Exception):
    """The gate refused the request; answer `status` with Retry-After: `retry_after_s`."""

    status = 429
    reason = "quota"

    def __init__(self, message: str, *, retry_after_s: float, est_wait_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.est_wait_s = est_wait_s


class QueueFull(AdmissionRejected):
    reason = "queue_full"


class WorkerFull(AdmissionRejected):
    """Step two of two-step admission: the chosen worker has no room. Nothing was taken: route to
    another worker, or acquire without one and wait."""

    status = 503
    reason = "worker_full"


class SloUnreachable(AdmissionRejected):
    """The chosen worker's predicted time to first token already misses the request's SLO (Mooncake's
    early rejection): refused at the door rather than after a wait it could not survive."""

    reason = "slo_unreachable"


class QueueTooDeep(AdmissionRejected):
    """The engine-queue guard (policy.admission.queue_too_deep): the chosen worker's predicted queue
    is longer than `[admission] max_queue_ms`; refused at the door, nothing taken."""

    reason = "queue_too_deep"


class QuotaMissing(AdmissionRejected):
    """The model has no quota hash in Redis (restarted, or the key was deleted): refused, never admitted
    without limits, until a gateway writes the configured quota again."""

    status = 503
    reason = "quota_missing"


class LeaseLost(Exception):
    """A lease expired in Redis (not renewed in time): its seats are no longer held."""


class WaitBudgetExceeded(AdmissionRejected):
    """The request waited its whole budget (the caller picks 429 or 504)."""

    reason = "wait_budget"


async def set_quota(redis: aioredis.Redis, model: str, quota: Quota) -> None:
    """Replace the model's limits at run time; every gateway's next script call uses them, and no
    gateway's re-assertion of its configured quota overwrites them (origin=operator, plugin/quotas.py)."""
    now_s, now_us = await redis.time()
    meta = {"origin": "operator", "v": str(now_s * 1000 + now_us // 1000)}
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(quota_key(model))
        pipe.hset(quota_key(model), mapping=dict(quota.to_hash()) | meta)  # type: ignore[arg-type]
        await pipe.execute()
    logger.info("admission quota for model %s set to %s", model, quota.to_hash())


async def get_quota(redis: aioredis.Redis, model: str) -> Quota:
    flat = await redis.hgetall(quota_key(model))
    return Quota.from_hash({_text(k): _text(v) for k, v in flat.items()})


async def live_leases(redis: aioredis.Redis, model: str) -> dict[str, dict[str, Any]]:
    """Request id -> {seats, band, tenant, worker, gateway, granted_ms, expiry_ms} of the model's
    unexpired leases (read-only, for the drift audit against agents' in-flight ids)."""
    keys = model_keys(model)
    clock: Any = await redis.time()
    now_s, now_us = clock
    live: list[Any] = await redis.zrangebyscore(
        keys[1], f"({now_s * 1000 + now_us // 1000}", "+inf", withscores=True
    )
    records = await redis.hmget(keys[2], [rid for rid, _ in live]) if live else []
    out: dict[str, dict[str, Any]] = {}
    for (rid, expiry), record in zip(live, records, strict=True):
        if record is None:
            continue
        info = json.loads(record)
        out[_text(rid)] = {
            "seats": info["s"], "band": Band(info["b"]), "tenant": info["t"], "worker": info.get("k") or None,
            "gateway": info.get("w"), "granted_ms": info["g"], "expiry_ms": int(expiry),
        }  # fmt: skip
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class SlotPool:
    """This gateway's leases and waiters; one per process, shared by every flow."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        gateway_id: str,
        lease_ms: int = 10_000,
        renew_every_ms: int = 2_000,
        recheck_every_s: float = 1.0,
        channel: str = GRANTED_CHANNEL,
        on_quota_missing: Callable[[str], Awaitable[object]] | None = None,
    ) -> None:
        if renew_every_ms >= lease_ms:
            raise ValueError(f"renew_every_ms ({renew_every_ms}) must be shorter than lease_ms ({lease_ms})")
        self.redis = redis
        self.gateway_id = gateway_id
        self.lease_ms = lease_ms
        self.renew_every_ms = renew_every_ms
        self.recheck_every_s = recheck_every_s
        self.scripts: AdmissionScripts = register_scripts(redis, channel)
        self._channel = channel
        self._held: dict[str, Lease] = {}
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._freed: dict[str, asyncio.Future[None]] = {}  # model -> resolved by a placed lease's release
        self._pubsub: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.leases_lost = 0  # leases that expired before renewal (a stalled loop or Redis outage)
        self.leases_reclaimed = 0  # of those, taken back for their running request (seats were free)
        self.on_quota_missing = on_quota_missing  # writes the model's quota again (plugin/quotas.py)

    async def start(self) -> None:
        # plain pub/sub on a cluster too: a PUBLISH (from a script on any master) reaches every node,
        # so one subscription on one node hears every model's grants (docs/REDIS.md, Cluster)
        await connect.ready(self.redis)
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(self._channel)
        self._tasks = [
            spawn(self._listen(), name=f"slots-listen-{self.gateway_id}"),
            spawn(self._renew_forever(), name=f"slots-renew-{self.gateway_id}"),
        ]

    async def close(self) -> None:
        """Stop the background tasks. Held leases are not released: they expire unless renewed."""
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
            self._pubsub = None
        await self.scripts.aclose()

    async def __aenter__(self) -> SlotPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def held(self) -> int:
        return len(self._held)

    def held_seats(self, model: str) -> int:
        """Seats of `model` this process holds (leases from Redis and local ones)."""
        return sum(lease.seats for lease in self._held.values() if lease.model == model)

    def hold_local(self, ticket: Ticket, seats: int, worker: str) -> Lease:
        """A lease taken without Redis (gateway.redis_failure = "open", plugin/open_admission.py): held
        and renewed like the others, so the first renewal after Redis answers again takes it in
        (reclaim, within the quota) or drops it from these books; released once either way."""
        return self._hold(ticket, seats, time.monotonic(), worker)

    async def snapshot(self, model: str) -> dict[str, Any]:
        """The model's admission state (store.scripts.AdmissionScripts.snapshot) plus `est_wait_s`, the
        expected wait of a request arriving now at the back of all queues (the autoscaling signal)."""
        snap = await self.scripts.snapshot(model)
        capacity = int(snap["quota"].get("total", -1))
        queued = sum(snap["queued"].values())
        snap["est_wait_s"] = estimated_wait_s(queued, capacity, snap["hold_ms"] / 1000) if queued else 0.0
        return snap

    async def acquire(
        self, ticket: Ticket, worker: str | None = None, on_queued: Callable[[], None] | None = None
    ) -> Lease:
        """Seats for `ticket`, waiting up to its budget (`on_queued` is called when the wait starts).
        Raises QueueFull, WaitBudgetExceeded or AdmissionRejected (no seat and max_wait_s = 0).
        Cancellation-safe.

        With `worker` (the routing choice), the same round trip also checks that worker's capacity and
        raises WorkerFull if it has none; the lease is placed on it if admitted at once. A request that
        waited is not placed (lease.worker is None): route it again and call `place()`."""
        rid = ticket.request_id
        start = time.monotonic()
        # register before asking: a grant may be published before the script's reply arrives
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = granted
        settled = False  # True once Redis holds neither a lease we do not know of nor a queue entry
        try:
            reply = await self._acquire_once(ticket, worker)
            if reply.code == AdmitCode.QUOTA_MISSING and self.on_quota_missing is not None:
                await self.on_quota_missing(ticket.model)  # written again: one more try
                reply = await self._acquire_once(ticket, worker)
            if reply.code in (AdmitCode.ADMITTED, AdmitCode.ALREADY_HELD):
                settled = True
                placed = worker if reply.code == AdmitCode.ADMITTED else None
                return self._hold(ticket, reply.seats or ticket.seats, start, placed)
            est = estimated_wait_s(reply.ahead, reply.capacity, reply.hold_ms / 1000)  # (not when admitted)
            if reply.code in (
                AdmitCode.QUEUE_FULL,
                AdmitCode.NO_SEAT,
                AdmitCode.WORKER_FULL,
                AdmitCode.QUOTA_MISSING,
            ):
                settled = True
                raise _rejection(ticket, reply.code, est)
            if on_queued is not None:
                on_queued()
            lease = await self._wait(ticket, granted, reply.seats, start, est)
            settled = True
            return lease
        except (RedisError, OSError):
            # Redis unreachable or too slow: answer now; leaving is tried in the background (and
            # whatever Redis may hold for this id expires on its own)
            settled = True
            spawn(self._leave(ticket.model, rid), name="slots-leave-late")
            raise
        finally:
            self._waiters.pop(rid, None)
            if not settled:
                # cancelled, out of budget or failed while queued (or admitted without our knowing):
                # leave the queue / release a raced grant, even while this task is being cancelled
                await _shielded(self._leave(ticket.model, rid))

    async def _acquire_once(self, ticket: Ticket, worker: str | None) -> AdmitResult:
        return await self.scripts.acquire(
            ticket.model, ticket.request_id, ticket.band, ticket.tenant, ticket.seats, self.lease_ms,
            int(ticket.max_wait_s * 1000), self.gateway_id, worker=worker,
        )  # fmt: skip

    async def _wait(
        self, ticket: Ticket, granted: asyncio.Future[None], seats: int, start: float, est: float
    ) -> Lease:
        deadline = start + ticket.max_wait_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(asyncio.shield(granted), min(remaining, self.recheck_every_s))
                return self._hold(ticket, seats, start)
            except TimeoutError:
                check = await self.scripts.check(ticket.model, ticket.request_id)
                if check.status == CheckStatus.HELD:
                    return self._hold(ticket, seats, start)
                if check.status == CheckStatus.GONE:
                    break  # Redis dropped us: our wait budget ran out there first
                est = estimated_wait_s(check.ahead, check.capacity, check.hold_ms / 1000)
        raise WaitBudgetExceeded(
            f"waited {ticket.max_wait_s:g} s for a seat on {ticket.model}", retry_after_s=max(1.0, est),
            est_wait_s=est,
        )  # fmt: skip

    def _hold(self, ticket: Ticket, seats: int, start: float, worker: str | None = None) -> Lease:
        queued_s = time.monotonic() - start
        lease = Lease(ticket.request_id, ticket.model, ticket.band, ticket.tenant, seats, queued_s, worker)
        self._held[lease.request_id] = lease
        return lease

    async def place(self, lease: Lease, worker: str) -> Lease:
        """Step two for a lease granted after waiting: place it on `worker` if that worker has room
        (one round trip). Returns the placed lease; raises WorkerFull (the lease is kept: try another
        worker) or LeaseLost (it expired meanwhile)."""
        reply = await self.scripts.claim(lease.model, lease.request_id, worker)
        if reply.code == ClaimCode.WORKER_FULL:
            raise WorkerFull(f"worker {worker} is full", retry_after_s=1.0, est_wait_s=0.0)
        if reply.code == ClaimCode.GONE:
            self._held.pop(lease.request_id, None)
            raise LeaseLost(f"lease of {lease.request_id} expired before it was placed")
        placed = dataclasses.replace(lease, worker=worker)
        if lease.request_id in self._held:
            self._held[lease.request_id] = placed
        return placed

    async def release(self, lease: Lease) -> None:
        """Give the seats back (one round trip); a second call for the same lease does nothing."""
        if self._held.pop(lease.request_id, None) is None:
            return
        await self.scripts.release(lease.model, lease.request_id, worker=lease.worker)
        if lease.worker is not None:
            self._room(lease.model)

    async def release_many(self, leases: Sequence[Lease]) -> None:
        """`release` for each lease, in one round trip (one pipelined write)."""
        held = [lease for lease in leases if self._held.pop(lease.request_id, None) is not None]
        if not held:
            return
        await self.scripts.release_many([(lease.model, lease.request_id, lease.worker) for lease in held])
        for model in {lease.model for lease in held if lease.worker is not None}:
            self._room(model)

    def _room(self, model: str) -> None:
        freed = self._freed.pop(model, None)
        if freed is not None and not freed.done():
            freed.set_result(None)

    def room_signal(self, model: str) -> asyncio.Future[None]:
        """Resolved at the next sign that a worker of `model` may have a free place: this process
        released a lease placed on a worker, or any gateway's release took a worker from full to one
        free place (a message on the grants channel). Take it before trying a worker, so that a
        release during the try is not missed. A place freed by an expired lease gives no sign."""
        freed = self._freed.get(model)
        if freed is None or freed.done():
            freed = self._freed[model] = asyncio.get_running_loop().create_future()
        return freed

    async def room_freed(
        self, model: str, timeout_s: float, signal: asyncio.Future[None] | None = None
    ) -> bool:
        """Wait for `signal` (default: the model's next one, see `room_signal`) up to `timeout_s`;
        True if it came."""
        freed = signal if signal is not None else self.room_signal(model)
        try:
            await asyncio.wait_for(asyncio.shield(freed), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _leave(self, model: str, rid: str) -> None:
        try:
            reply = await self.scripts.release(model, rid)
        except (RedisError, OSError) as e:  # Redis down: its queue entry and lease expire on their own
            logger.warning("request %s could not leave admission (%s): it expires", rid, e)
            return
        logger.debug("request %s left admission: %s", rid, reply.code.name)

    async def _listen(self) -> None:
        """Wake local waiters named in grant messages; reconnects after errors."""
        failures = 0
        while True:
            try:
                async for message in self._pubsub.listen():
                    failures = 0
                    if message.get("type") == "message":
                        self._wake(message["data"])
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:  # Redis down or restarted: no traceback per retry
                logger.warning("admission grant subscription failed (%s); retrying", e)
                await asyncio.sleep(0.5)
            except Exception:
                failures += 1
                logger.warning("admission grant subscription failed; retrying", exc_info=True)
                await asyncio.sleep(reconnect.delay_s(failures))

    def _wake(self, data: bytes | str) -> None:
        try:
            ids = json.loads(data)
        except ValueError:
            logger.warning("bad admission grant message: %r", data)
            return
        if isinstance(ids, dict) and isinstance(ids.get("freed"), str):
            self._room(ids["freed"])
            return
        for rid in ids if isinstance(ids, list) else []:
            future = self._waiters.get(str(rid))
            if future is not None and not future.done():
                future.set_result(None)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_every_ms / 1000)
            try:
                await self.renew_now()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:  # Redis down: one line, not a traceback per period
                logger.warning("lease renewal failed (%s: %s); retrying next period", type(e).__name__, e)
            except Exception:
                logger.warning("lease renewal failed; retrying next period", exc_info=True)

    async def renew_now(self) -> None:
        """Renew every held lease: one round trip per model."""
        by_model: dict[str, list[str]] = defaultdict(list)
        for lease in list(self._held.values()):
            by_model[lease.model].append(lease.request_id)
        for model, rids in by_model.items():
            reply = await self.scripts.renew(model, rids, self.lease_ms)
            for rid in reply.lost:
                held = self._held.get(rid)
                if held is not None and not await self._reclaim(held):
                    self._held.pop(rid, None)
                    self.leases_lost += 1
                    logger.warning("lease of request %s on %s expired before renewal", rid, model)

    async def _reclaim(self, lease: Lease) -> bool:
        """Take the seats of a lease Redis lost (it restarted, or the lease lapsed) back for the request
        that is still running, if they are free now (no wait): so that the running requests count
        against the quota again and newcomers are not admitted over it."""
        if self.on_quota_missing is not None:
            await self.on_quota_missing(lease.model)  # a restarted Redis has no quota yet either
        reply = await self.scripts.acquire(
            lease.model, lease.request_id, lease.band, lease.tenant, lease.seats, self.lease_ms, 0,
            self.gateway_id, worker=lease.worker, reclaim=True,
        )  # fmt: skip
        if reply.code in (AdmitCode.ADMITTED, AdmitCode.ALREADY_HELD):
            self.leases_reclaimed += 1
            return True
        return False


def _rejection(ticket: Ticket, code: AdmitCode, est: float) -> AdmissionRejected:
    retry = max(1.0, est)
    if code == AdmitCode.QUOTA_MISSING:
        return QuotaMissing(
            f"no admission quota for {ticket.model} in Redis (it restarted or the key was deleted); "
            "refused until a gateway writes it again",
            retry_after_s=1.0, est_wait_s=0.0,
        )  # fmt: skip
    if code == AdmitCode.WORKER_FULL:
        return WorkerFull(f"the chosen worker for {ticket.model} is full", retry_after_s=1.0, est_wait_s=0.0)
    if code == AdmitCode.QUEUE_FULL:
        band = ticket.band.name.lower()
        return QueueFull(f"{band} queue of {ticket.model} is full", retry_after_s=retry, est_wait_s=est)
    return AdmissionRejected(
        f"no seat free on {ticket.model} and the request would not wait", retry_after_s=retry, est_wait_s=est
    )


async def _shielded(coro: Any) -> None:
    """Run `coro` to completion even if the caller is being cancelled."""
    task = spawn(coro, name="slots-leave")
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)
