"""Model quotas from the gateway config, re-asserted in Redis where the admission scripts read them.

A model's limit is `[models."<m>"].total` if set, else `admission.default_total`, else derived from
its workers (count × their reported max_concurrency) once they report it; with none of these the
model is explicitly unlimited (a hash without `total`). With `band_shares` the total is split into
nominal band seats (policy.admission.default_quota, as in the simulator's kvgate gate); without,
bands share the total in the queues' priority order.

Every gateway re-asserts the configured quota on every mirror refresh and at once when an acquire
finds the hash missing (store/lua/quota.lua, one round trip per model): a hash lost with a Redis
restart is written again within a refresh period, and until then the scripts refuse rather than
admit without limits. The hash carries a version and an origin; an operator's run-time `HSET` of a
limit is detected (the limits no longer match the digest the gateways wrote) and kept by every
gateway, restarted or not, until the operator deletes the hash (docs/ADMISSION.md: `kvg:{m}:quota`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from plugin.config import GatewayConfig, ModelSection
from plugin.mirror import ClusterMirror, wall_ms
from policy.admission import Quota, default_quota
from store.scripting import load
from store.scripts import quota_key
from store.slots import set_quota

logger = logging.getLogger(__name__)

QUOTA_LUA = load("quota.lua")
ASSERT_OUTCOMES = {
    0: "unchanged", 1: "written (was missing)", 2: "replaced (config changed)", 3: "kept (run-time change)",
}  # fmt: skip
_last_outcome: dict[tuple[int, str], int] = {}  # (id of the redis client, model) -> last outcome logged
_last_version: dict[tuple[int, str], str] = {}  # (id of the redis client, model) -> quota version seen


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
    """An operator's run-time quota (origin=operator: the gateways keep it)."""
    await set_quota(redis, model, quota)


def limits_digest(fields: dict[str, str]) -> str:
    """sha1 of the sorted `field=value` lines, as quota.lua computes it over a stored hash."""
    return hashlib.sha1("\n".join(sorted(f"{k}={v}" for k, v in fields.items())).encode()).hexdigest()


async def assert_quota(
    redis: aioredis.Redis, model: str, quota: Quota, gateway_id: str, recover_ms: int = 0
) -> tuple[int, str]:
    """Write `quota` as the configured one unless it is there already or a run-time change stands;
    returns quota.lua's outcome code (ASSERT_OUTCOMES) and the stored version. A hash written because
    it was missing admits only reclaimed leases for `recover_ms` (store/lua/quota.lua)."""
    fields = quota.to_hash()
    flat = [x for pair in sorted(fields.items()) for x in pair]
    argv = [limits_digest(fields), gateway_id, str(recover_ms), *flat]
    code, version = await QUOTA_LUA(redis, [quota_key(model)], argv)
    return int(code), version.decode() if isinstance(version, bytes) else str(version)


def configured_quota(config: GatewayConfig, mirror: ClusterMirror, model: str) -> Quota:
    """The quota this gateway asserts for `model`; explicitly unlimited (no total) when none applies."""
    now = wall_ms()
    live = [w for w in mirror.workers(model) if w.lease_expiry_ms > now]
    return desired_quota(config, model, [w.max_concurrency for w in live]) or Quota(count_seats=False)


async def ensure_quotas(
    redis: aioredis.Redis,
    config: GatewayConfig,
    mirror: ClusterMirror,
    models: Sequence[str],
    gateway_id: str = "",
    *,
    recover_ms: int = 0,
    on_rewritten: Callable[[str], object] | None = None,
) -> None:
    """Re-assert every model's configured quota (one round trip per model); errors are logged.
    `on_rewritten(model)` is called when the hash was written again after going missing, by this
    gateway or (a new version seen) by another one: Redis lost the leases, so take ours back now."""
    for model in sorted({*models, *config.models}):
        quota = configured_quota(config, mirror, model)
        key = (id(redis), model)
        # a grace only when the hash went missing after this gateway saw it (Redis lost it, and with it
        # the leases); a first write on a fresh Redis admits at once
        grace = recover_ms if key in _last_version else 0
        try:
            code, version = await assert_quota(redis, model, quota, gateway_id, grace)
        except (RedisError, OSError) as e:
            logger.warning("quota of %s not asserted: %s", model, e)
            continue
        previous = _last_version.get(key)
        _last_version[key] = version
        if on_rewritten is not None and (code == 1 or (code == 0 and previous not in (None, version))):
            on_rewritten(model)
        if code == 1:  # every time: a lost quota is an incident
            logger.warning(
                "kvgate: quota of %s was missing in Redis (restarted or deleted); written again: total %s",
                model, quota.total,
            )  # fmt: skip
        elif code != 0 and _last_outcome.get(key) != code:
            logger.info("kvgate: quota of %s %s: total %s", model, ASSERT_OUTCOMES[code], quota.total)
        _last_outcome[key] = code
