"""Model quotas from the gateway config, written to Redis where the admission scripts read them.

A model's limit is `[models."<m>"].total` if set, else `admission.default_total`, else derived from
its workers (count × their reported max_concurrency, policy.admission.default_quota) once they
report it; with none of these the model has no quota (unlimited). This process writes a quota only
when the value it would write changes, so an operator's run-time change in Redis stands until the
config or the worker pool changes (docs/ADMISSION.md: `kvg:{m}:quota`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from plugin.config import GatewayConfig
from plugin.mirror import ClusterMirror, wall_ms
from plugin.slots import set_quota
from policy.admission import Quota, default_quota

logger = logging.getLogger(__name__)

_written: dict[tuple[int, str], Quota] = {}  # (id of the redis client, model) -> what this process wrote


def desired_quota(config: GatewayConfig, model: str, concurrencies: Sequence[int]) -> Quota | None:
    """The quota the config asks for `model`, given its live workers' max_concurrency values."""
    section = config.models.get(model)
    total = section.total if section and section.total else config.admission.default_total
    if total:
        return Quota(
            total=total,
            tenant=section.tenant if section and section.tenant else None,
            queue_max=section.queue_max if section and section.queue_max else Quota().queue_max,
            count_seats=bool(section and section.count_seats),
        )
    if concurrencies and all(c > 0 for c in concurrencies):
        derived = default_quota(len(concurrencies), min(concurrencies))
        return Quota(total=derived.total, count_seats=bool(section and section.count_seats))
    return None


async def write_quota(redis: aioredis.Redis, model: str, quota: Quota) -> None:
    await set_quota(redis, model, quota)


async def ensure_quotas(
    redis: aioredis.Redis, config: GatewayConfig, mirror: ClusterMirror, models: Sequence[str]
) -> None:
    now = wall_ms()
    for model in sorted({*models, *config.models}):
        live = [w for w in mirror.workers(model) if w.lease_expiry_ms > now]
        quota = desired_quota(config, model, [w.max_concurrency for w in live])
        if quota is None or _written.get((id(redis), model)) == quota:
            continue
        try:
            await write_quota(redis, model, quota)
        except (RedisError, OSError) as e:
            logger.warning("quota of %s not written: %s", model, e)
            continue
        _written[(id(redis), model)] = quota
        logger.info("kvgate: quota of %s: total %s", model, quota.total)
