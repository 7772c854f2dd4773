"""Model quotas from the gateway config, written to Redis where the admission scripts read them.

A model's limit is `[models."<m>"].total` if set, else `admission.default_total`, else derived from
its workers (count × their reported max_concurrency) once they report it; with none of these the
model has no quota (unlimited). With `band_shares` the total is split into nominal band seats
(policy.admission.default_quota, as in the simulator's kvgate gate); without, bands share the total
in the queues' priority order. This
process writes a quota only when the value it would write changes, so an operator's run-time change
in Redis stands until the config or the worker pool changes (docs/ADMISSION.md: `kvg:{m}:quota`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from plugin.config import GatewayConfig, ModelSection
from plugin.mirror import ClusterMirror, wall_ms
from policy.admission import Quota, default_quota
from store.slots import set_quota

logger = logging.getLogger(__name__)

_written: dict[tuple[int, str], Quota] = {}  # (id of the redis client, model) -> what this process wrote


def desired_quota(config: GatewayConfig, model: str, concurrencies: Sequence[int]) -> Quota | None:
    """The quota the config asks for `model`, given its live workers' max_concurrency values: its
    total split into band shares (`default_quota`), with the model's tenant cap and queue limit."""
    section = config.models.get(model) or ModelSection()
    total = section.total or config.admission.default_total
    if not total and concurrencies and all(c > 0 for c in concurrencies):
        total = len(concurrencies) * min(concurrencies)
    if not total:
        return None
    shares = section.shares(config.admission.band_shares)
    split = default_quota(1, total, shares) if shares else Quota(total=total)
    return dataclasses.replace(
        split,
        tenant=section.tenant or None,
        queue_max=section.queue_max or Quota().queue_max,
        count_seats=section.count_seats,
    )


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
        logger.info("kvgate: quota of %s: total %s, bands %s", model, quota.total, quota.band or "-")
