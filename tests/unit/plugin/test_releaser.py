"""plugin/releaser.py: leases given back in one loop tick reach Redis together; close sends the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio as aioredis

from plugin.releaser import Releaser
from policy.admission import Quota
from policy.types import Band
from store.slots import Lease, SlotPool, Ticket, set_quota
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


async def test_a_batch_is_sent_after_what_the_loop_had_scheduled_when_it_was_queued(
    redis: aioredis.Redis, redis_url: str
) -> None:
    """mitmproxy writes a response one loop iteration after the `response` hook that released its
    lease: the batch must go out after that write, not before it."""
    await set_quota(redis, M, Quota(total=8))
    client = aioredis.Redis.from_url(redis_url)
    pool = SlotPool(client, gateway_id="gw", lease_ms=60_000, renew_every_ms=10_000)
    await pool.start()
    order: list[str] = []
    try:
        releaser = Releaser(pool)
        await releaser.start()
        lease = await pool.acquire(Ticket("w0", M, Band.NORMAL, "t"))
        real = pool.release_many

        async def release_many(leases: Sequence[Lease]) -> None:
            order.append("send")
            await real(leases)

        pool.release_many = release_many  # type: ignore[method-assign]
        releaser.release(lease)  # in the hook
        asyncio.get_running_loop().call_soon(order.append, "response written")  # the next iteration
        await until(lambda: _is(pool, 0), "the release to reach Redis")
        assert order == ["response written", "send"]
        await releaser.close()
    finally:
        await pool.close()
        await client.aclose()
