"""plugin/releaser.py: leases given back in one loop tick reach Redis together; close sends the rest."""

from __future__ import annotations

import redis.asyncio as aioredis

from plugin.releaser import Releaser
from policy.admission import Quota
from policy.types import Band
from store.slots import SlotPool, Ticket, set_quota
from tests.polling import until

M = "m"


async def leases_in_redis(pool: SlotPool) -> int:
    return int((await pool.snapshot(M))["leases"])


async def test_released_leases_reach_redis_in_the_background_and_on_close(
    redis: aioredis.Redis, redis_url: str
) -> None:
    await set_quota(redis, M, Quota(total=8))
    client = aioredis.Redis.from_url(redis_url)
    pool = SlotPool(client, gateway_id="gw", lease_ms=60_000, renew_every_ms=10_000)
    await pool.start()
    try:
        releaser = Releaser(pool)
        await releaser.start()
        leases = [await pool.acquire(Ticket(f"r{i}", M, Band.NORMAL, "t")) for i in range(3)]
        assert await leases_in_redis(pool) == 3
        for lease in leases[:2]:
            releaser.release(lease)  # the same tick: one batch
        await until(lambda: _is(pool, 1), "the two releases to reach Redis")
        releaser.release(leases[2])
        await releaser.close()  # stops the loop and sends what is queued
        assert await leases_in_redis(pool) == 0 and releaser.released == 3
    finally:
        await pool.close()
        await client.aclose()


async def _is(pool: SlotPool, n: int) -> bool:
    return await leases_in_redis(pool) == n
