"""The gateway's own endpoints: /v1/models, /healthz and /metrics (rendered at scrape time)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from mitmproxy import http
from redis.exceptions import RedisError

from plugin.errors import json_response
from plugin.metrics import GatewayMetrics
from plugin.mirror import ClusterMirror, wall_ms
from plugin.process_state import ProcessState
from plugin.routing import Router
from store.slots import SlotPool

logger = logging.getLogger(__name__)


class LocalEndpoints:
    """Answers the endpoints intake does not forward; every part it reads is passed in."""

    def __init__(
        self,
        *,
        gateway_id: str,
        redis: aioredis.Redis | None,
        pool: SlotPool | None,
        mirror: ClusterMirror | None,
        router: Router,
        metrics: GatewayMetrics,
        process: ProcessState,
    ) -> None:
        self.gateway_id = gateway_id
        self.redis, self.pool, self.mirror, self.router = redis, pool, mirror, router
        self.metrics, self.process = metrics, process

    async def serve(self, endpoint: str) -> http.Response:
        if endpoint == "models":
            served = self.mirror.served_models() if self.mirror else []
            data = [{"id": m, "object": "model", "owned_by": "kvgate", "created": 0} for m in served]
            return json_response(200, {"object": "list", "data": data})
        if endpoint == "healthz":
            return await self.health()
        return http.Response.make(
            200, (await self.render_metrics()).encode(), {"content-type": "text/plain; version=0.0.4"}
        )

    async def health(self) -> http.Response:
        redis_ok = False
        if self.redis is not None:
            with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
                redis_ok = bool(await asyncio.wait_for(self.redis.ping(), 1.0))
        live = 0
        if self.mirror is not None:
            live = sum(len(self.mirror.routable(m)) for m in self.mirror.models())
        draining = self.process.draining
        ok = redis_ok and live > 0 and not draining
        body = {"status": "ok" if ok else "unavailable", "redis": redis_ok, "live_workers": live,
                "draining": draining, "gateway": self.gateway_id}  # fmt: skip
        return json_response(200 if ok else 503, body)

    async def render_metrics(self) -> str:
        m = self.metrics
        m.draining.set(1.0 if self.process.draining else 0.0)
        for model, n in self.process.queued.items():
            m.queue_length.set(n, model)
        if self.mirror is not None:
            now = wall_ms()
            for model in self.mirror.models():
                workers = self.mirror.workers(model)
                live = [w for w in workers if w.lease_expiry_ms > now]
                m.workers.set(sum(1 for w in live if not w.draining), model, "routable")
                m.workers.set(sum(1 for w in live if w.draining), model, "draining")
                m.workers.set(len(workers) - len(live), model, "expired")
                routing = self.router.models.get(model)
                if routing is not None:
                    m.inflight.set(sum(routing.inflight.values()), model)
                await self._global_admission_metrics(model)
        return m.render()

    async def _global_admission_metrics(self, model: str) -> None:
        if self.pool is None:
            return
        try:
            snap = await asyncio.wait_for(self.pool.snapshot(model), 1.0)
        except (RedisError, OSError, TimeoutError) as e:
            logger.debug("admission snapshot of %s failed: %s", model, e)
            return
        self.metrics.seats_used.set(snap["used"]["total"], model)
        for band, queued in snap["queued"].items():
            self.metrics.global_queue.set(queued, model, band)
