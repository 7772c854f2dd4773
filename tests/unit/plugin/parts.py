"""A `GatewayContext` of real services for the per-part tests (test_intake.py, test_admit.py, ...).

A part under test gets the same bundle the addon builds, over the test's embedded Redis, without
the addon itself: no mitmproxy options, no background task but the release loop; the test drives the
mirror (`await ctx.workers.mirror.refresh()`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis

from plugin.auth import Auth
from plugin.config import config_from_dict
from plugin.context import GatewayContext
from plugin.decision_log import DecisionLog
from plugin.local import LocalEndpoints
from plugin.metrics import GatewayMetrics
from plugin.mirror import ClusterMirror
from plugin.prefix_memo import PromptHasher
from plugin.process_state import ProcessState
from plugin.releaser import Releaser
from plugin.routing import Router
from plugin.sessions import SessionAffinity
from plugin.workers import WorkerPool
from policy.pressure import PressureTracker
from store.slots import SlotPool


@asynccontextmanager
async def gateway_context(
    redis: aioredis.Redis, config: Mapping[str, Any] | None = None
) -> AsyncIterator[GatewayContext]:
    """The services of one gateway ("t") from a config dict (TOML's shape), its mirror refreshed once."""
    cfg = config_from_dict(config or {})
    metrics = GatewayMetrics()
    mirror = ClusterMirror(redis, tail_index=False)
    router = Router(cfg.routing)
    process = ProcessState()
    async with SlotPool(redis, gateway_id="t") as pool:
        local = LocalEndpoints(
            gateway_id="t",
            redis=redis,
            pool=pool,
            mirror=mirror,
            router=router,
            metrics=metrics,
            process=process,
        )
        releaser = Releaser(pool)
        await releaser.start()
        try:
            yield GatewayContext(
                gateway_id="t", config=cfg, auth=Auth(cfg), metrics=metrics, workers=WorkerPool(mirror),
                router=router, hasher=PromptHasher(), pool=pool, releaser=releaser,
                pressure=PressureTracker(), decisions=DecisionLog(None), process=process, local=local,
                sessions=SessionAffinity(redis, router.policy_config.session.ttl_s, metrics),
            )  # fmt: skip
        finally:
            await releaser.close()
