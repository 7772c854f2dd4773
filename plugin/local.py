"""The proxy port's own endpoints (/v1/models, /readyz) and the refresher of what the metrics port
serves (/metrics gauges, the /readyz snapshot; /metrics and /healthz are only there, issue 10).

Liveness and readiness are separate: /healthz (metrics port) is 200 while the process serves at all (a
Redis outage or an empty worker pool is no reason to restart a gateway: restarting every pod at
once on a Redis blip helps nobody); /readyz is 200 only while Redis answers, a worker is routable
and the gateway is not draining (a load balancer sends it no traffic otherwise)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis
from mitmproxy import http
from redis.exceptions import RedisError

from plugin.errors import json_response
from plugin.metrics import GatewayMetrics
from plugin.metrics_server import Readiness
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
        self.readiness = Readiness(gateway=gateway_id)  # what the metrics port's /readyz reads

    async def serve(self, endpoint: str) -> http.Response:
        """The proxy port's own endpoints: /v1/models and /readyz (/metrics and /healthz are only on
        the metrics port, plugin/metrics_server.py)."""
        if endpoint == "models":
            served = self.mirror.served_models() if self.mirror else []
            data = [{"id": m, "object": "model", "owned_by": "kvgate", "created": 0} for m in served]
            return json_response(200, {"object": "list", "data": data})
        return await self.health()

    async def health(self) -> http.Response:
        """Readiness: Redis answers PING, a worker is routable, not draining."""
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

    async def refresh(self) -> None:
        """Set the scrape-time gauges and the readiness snapshot (the metrics port serves both)."""
        m = self.metrics
        m.draining.set(1.0 if self.process.draining else 0.0)
        for model, n in self.process.queued.items():
            m.queue_length.set(n, model)
        live_total = 0
        if self.mirror is not None:
            now = wall_ms()
            for model in self.mirror.models():
                workers = self.mirror.workers(model)
                live = [w for w in workers if w.lease_expiry_ms > now]
                live_total += sum(1 for w in live if not w.draining)
                m.workers.set(sum(1 for w in live if not w.draining), model, "routable")
                m.workers.set(sum(1 for w in live if w.draining), model, "draining")
                m.workers.set(len(workers) - len(live), model, "expired")
                routing = self.router.models.get(model)
                inflight = routing.inflight if routing is not None else {}
                if routing is not None:
                    m.inflight.set(sum(inflight.values()), model)
                for w in workers:
                    m.worker_inflight.set(inflight.get(w.id, 0), model, w.id)
                    m.worker_kv_usage.set(w.kv_usage, model, w.id)
                    m.worker_lease_age.set(max(0.0, (now - w.updated_ms) / 1000) if w.updated_ms else 0.0,
                                           model, w.id)  # fmt: skip
                await self._global_admission_metrics(model)
            # a worker gone from the mirror takes its per-worker series with it
            m.drop_workers_except(
                {(model, w.id) for model in self.mirror.models() for w in self.mirror.workers(model)}
            )
        r = self.readiness
        r.redis = await self._ping()
        r.live_workers, r.draining, r.updated_at = live_total, self.process.draining, time.monotonic()

    async def _ping(self) -> bool:
        if self.redis is None:
            return False
        started = time.perf_counter()
        try:
            ok = bool(await asyncio.wait_for(self.redis.ping(), 1.0))
        except (RedisError, OSError, TimeoutError):
            self.metrics.redis_errors.inc()
            return False
        self.metrics.redis_seconds.observe(time.perf_counter() - started)
        return ok

    async def refresh_forever(self, period_s: float) -> None:
        """Keep the metrics port's gauges and readiness fresh (a task on the event loop)."""
        while True:
            try:
                await self.refresh()
            except Exception:  # a refresh must never stop: the next one may work
                logger.exception("kvgate: metrics refresh failed")
            await asyncio.sleep(period_s)

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
