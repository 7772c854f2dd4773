"""Static workers: URLs given to the gateway itself (`kvgate proxy --worker URL`), with no agent beside them.

The gateway registers each one in the shared registry (store/registry.py) and renews its lease after
each health check (GET /health every `period_s`) by the same rule the agents apply
(policy/liveness.py), so a dead static worker leaves the pool after its lease expires exactly like
an agent-managed one. The model comes from the
`--model` option or, when absent, the worker's own GET /v1/models.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from urllib.parse import urlsplit

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from plugin.mirror import wall_ms
from policy.liveness import Liveness, ProbeOutcome
from runtime.tasks import cancel_and_wait, spawn
from store import registry
from store.registry import WorkerRecord

logger = logging.getLogger(__name__)


def static_worker_id(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return "static-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{parts.hostname}-{parts.port or 80}")


class StaticWorkers:
    def __init__(
        self,
        redis: aioredis.Redis,
        urls: list[str],
        *,
        model: str = "",
        max_concurrency: int = 0,
        period_s: float = 1.0,
        lease_periods: int = 4,
        health_timeout_s: float = 2.0,
        slow_grace_s: float = 30.0,
        secret: bytes = b"",
    ) -> None:
        self.redis = redis
        self.secret = secret
        self.urls = [u if "://" in u else f"http://{u}" for u in urls]
        self.model = model
        self.max_concurrency = max_concurrency
        self.period_s = period_s
        self.lease_ms = int(period_s * lease_periods * 1000)
        self.health_timeout_s = health_timeout_s
        # Timeouts are tolerated for `slow_grace_s` worth of periods (the gateway's own loop is often
        # what is slow); a refused connection or an error status ends renewal at once.
        slow_periods = max(1, math.ceil(slow_grace_s / period_s))
        self._liveness = {url: Liveness(fail_periods=1, slow_periods=slow_periods) for url in self.urls}
        self.models: dict[str, tuple[str, ...]] = {}  # url -> models it serves (once known)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.health_timeout_s))
        await self.tick()  # registered before the gateway takes traffic
        self._task = spawn(self._loop(), name="kvgate-static-workers")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.tick()

    async def tick(self) -> None:
        await asyncio.gather(*(self._check(url) for url in self.urls))

    async def _check(self, url: str) -> None:
        if not self._liveness[url].observe(await self._probe(url)):
            return  # no renewal: the lease runs out and routing stops
        models = self.models.get(url) or await self._discover(url)
        if not models:
            return
        self.models[url] = models
        worker_id = static_worker_id(url)
        now = wall_ms()
        try:
            for model in models:
                renewed = await registry.heartbeat(
                    self.redis, model, worker_id, running=0, waiting=0, kv_usage=0.0,
                    lease_ms=self.lease_ms, now_ms=now, url=url, secret=self.secret,
                )  # fmt: skip
                if renewed is None:
                    record = WorkerRecord(
                        id=worker_id,
                        model=model,
                        url=url,
                        models=models,
                        max_concurrency=self.max_concurrency,
                    )
                    await registry.register(self.redis, record, self.lease_ms, now, self.secret)
                    logger.info("kvgate: registered static worker %s (%s) for %s", worker_id, url, model)
        except (RedisError, OSError, registry.RegistrationRefused) as e:
            logger.warning("static worker %s: registry update failed: %s", url, e)

    async def _probe(self, url: str) -> ProbeOutcome:
        assert self._session is not None
        try:
            async with self._session.get(f"{url}/health") as resp:
                return ProbeOutcome.HEALTHY if resp.status < 300 else ProbeOutcome.FAILED
        except TimeoutError:  # before ClientError: aiohttp's ServerTimeoutError is both
            return ProbeOutcome.SLOW
        except (aiohttp.ClientConnectorError, ConnectionRefusedError):
            return ProbeOutcome.REFUSED
        except (aiohttp.ClientError, OSError):
            return ProbeOutcome.FAILED

    async def _discover(self, url: str) -> tuple[str, ...]:
        if self.model:
            return (self.model,)
        assert self._session is not None
        try:
            async with self._session.get(f"{url}/v1/models") as resp:
                payload = await resp.json(content_type=None)
            return tuple(str(m["id"]) for m in payload.get("data", []) if isinstance(m, dict) and "id" in m)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError) as e:
            logger.warning("static worker %s: cannot list its models (%s); pass --model", url, e)
            return ()
