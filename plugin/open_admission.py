"""`gateway.redis_failure = "open"`: while Redis is unreachable, admit up to this gateway's local share.

The share of a model is `floor(total / gateways)` (docs/REDIS.md "Redis failure modes"): `total` is
the model's quota as last read from Redis (an operator's run-time change included; the configured
quota before the first read), `gateways` the number of gateways in open mode seen alive within
PRESENCE_WINDOW_S before Redis went away (each writes its id and time to `kvg:gateways:open` every
`routing.refresh_ms`; closed-mode gateways admit nothing during an outage, so they take no share).
A model without a total (unlimited) has no local limit either.

During the outage a request is admitted when this gateway's held seats of its model (leases taken in
Redis before the outage plus local ones) and its own seats fit the share; it is routed on the mirror
(plugin/mirror.py keeps the last registry it read) and never waits. Past the share it is answered 503
`redis_unavailable` with Retry-After, as in closed mode. A local admission is an ordinary lease held
by the slot pool (store/slots.py `hold_local`): once Redis answers again, the first renewal finds it
missing there and takes it in (acquire with reclaim, within the quota), so every running request is
counted once; one that does not fit is dropped from the pool's books and never released twice.

After a failure the next BREAKER_S of requests go straight to the local share (no request waits for
`redis_timeout_ms` on a paused Redis); the first request after that tries Redis again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from plugin.mirror import wall_ms
from runtime.tasks import cancel_and_wait, spawn
from store.keys import PREFIX
from store.scripts import quota_key
from store.slots import AdmissionRejected, Lease, SlotPool, Ticket

logger = logging.getLogger(__name__)

GATEWAYS_KEY = f"{PREFIX}:gateways:open"  # ZSET gateway id -> wall ms last seen (open mode only)
PRESENCE_WINDOW_S = 10.0  # a gateway not seen for this long no longer takes a share
BREAKER_S = 0.5  # after a Redis failure, requests this long go straight to the local share


class ShareFull(AdmissionRejected):
    """Redis is unreachable and this gateway's local share of the model is taken."""

    status = 503
    reason = "redis_unavailable"


class OpenShare:
    """This gateway's local share of each quota, and the presence beat that sizes it."""

    def __init__(
        self,
        redis: aioredis.Redis,
        pool: SlotPool,
        *,
        gateway_id: str,
        period_s: float,
        models: Callable[[], Sequence[str]],
        configured_total: Callable[[str], int | None],
    ) -> None:
        self.redis, self.pool, self.gateway_id = redis, pool, gateway_id
        self.period_s = period_s
        self.models = models  # the models to read quotas of (the mirror's and the config's)
        self.configured_total = configured_total  # before the first read from Redis
        self.gateways = 1  # open-mode gateways seen alive (this one included)
        self.totals: dict[str, int | None] = {}  # model -> total last read (None = unlimited)
        self.down_until = 0.0  # time.monotonic() until which Redis is not tried (BREAKER_S)
        self.outage = False  # a local admission was made since Redis last answered
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        with contextlib.suppress(RedisError, OSError):  # the loop tries again
            await self.beat()
        self._task = spawn(self._beat_forever(), name="kvgate-open-presence")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    # -- the share -----------------------------------------------------------------------------------
    def share(self, model: str) -> int | None:
        """Seats this gateway may hold of `model` while Redis is unreachable (None = no limit)."""
        total = self.totals[model] if model in self.totals else self.configured_total(model)
        return None if total is None else total // max(1, self.gateways)

    def skip_redis(self) -> bool:
        """True while the breaker is open: Redis failed less than BREAKER_S ago."""
        return time.monotonic() < self.down_until

    def failed(self) -> None:
        """Redis failed a request: open the breaker."""
        self.down_until = time.monotonic() + BREAKER_S

    def admit(self, ticket: Ticket, worker: str) -> Lease:
        """A lease on `worker` within the local share; ShareFull otherwise."""
        share = self.share(ticket.model)
        seats = ticket.seats if share is None else min(ticket.seats, max(share, 1))
        held = self.pool.held_seats(ticket.model)
        if share is not None and held + seats > share:
            raise ShareFull(
                f"the admission store is unreachable and this gateway's share of {ticket.model} "
                f"({share} of {self.totals.get(ticket.model, self.configured_total(ticket.model))} seats, "
                f"{self.gateways} gateways) is taken; retry shortly",
                retry_after_s=1.0, est_wait_s=0.0,
            )  # fmt: skip
        if not self.outage:
            logger.warning(
                "kvgate: Redis unreachable: admitting locally (redis_failure = open), share of %s: %s seats",
                ticket.model, share,
            )  # fmt: skip
        self.outage = True
        return self.pool.hold_local(ticket, seats, worker)

    # -- presence ------------------------------------------------------------------------------------
    async def beat(self) -> None:
        """Say this gateway is alive, count the live ones and read every model's total (one round trip)."""
        now = wall_ms()
        models = sorted(self.models())
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(GATEWAYS_KEY, {self.gateway_id: now})
            pipe.zremrangebyscore(GATEWAYS_KEY, "-inf", now - int(PRESENCE_WINDOW_S * 1000))
            pipe.zcard(GATEWAYS_KEY)
            for model in models:
                pipe.hget(quota_key(model), "total")
                pipe.exists(quota_key(model))
            replies = await pipe.execute()
        self.gateways = max(1, int(replies[2]))
        for i, model in enumerate(models):
            total, exists = replies[3 + 2 * i], replies[4 + 2 * i]
            if exists:  # a missing hash (Redis restarted) says nothing about the quota: keep the last
                self.totals[model] = int(total) if total is not None else None
        if self.outage:
            logger.info("kvgate: Redis answers again; local admissions are taken into it at the next renewal")
            self.outage = False

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            with contextlib.suppress(RedisError, OSError):  # the outage: the last count and totals stand
                await self.beat()

    async def leave(self) -> None:
        """A stopping gateway no longer takes a share."""
        with contextlib.suppress(RedisError, OSError):
            await self.redis.zrem(GATEWAYS_KEY, self.gateway_id)
