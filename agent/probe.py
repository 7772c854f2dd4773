"""Probing one worker over HTTP: health, load (Prometheus /metrics), in-flight ids, served models.

Each call has its own timeout; failures are counted and turned into a `Probe` that says what was seen
(`down` when the connection was refused: the worker process is not running).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

import aiohttp

from agent.config import AgentConfig
from agent.lease import Probe
from agent.scrape import MetricsParseError, WorkerLoad, extract_load, parse_prometheus

logger = logging.getLogger("kvgate.agent")


class WorkerProbe:
    def __init__(self, config: AgentConfig, session: aiohttp.ClientSession) -> None:
        self.config = config
        self.session = session
        self.counts: Counter[str] = Counter()
        self.inflight_supported = True

    async def _get(self, path: str) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=self.config.http_timeout_s)
        async with self.session.get(self.config.base_url + path, timeout=timeout) as resp:
            return resp.status, await resp.text()

    async def probe(self) -> Probe:
        try:
            status, _ = await self._get("/health")
        except aiohttp.ClientConnectorError:
            self.counts["probe_errors"] += 1
            return Probe(healthy=False, load=None, down=True)
        except TimeoutError:  # before ClientError: aiohttp's ServerTimeoutError is both
            self.counts["probe_errors"] += 1
            return Probe(healthy=False, load=None, timed_out=True)
        except aiohttp.ClientError:
            self.counts["probe_errors"] += 1
            return Probe(healthy=False, load=None)
        if status >= 300:
            self.counts["probe_errors"] += 1
            return Probe(healthy=False, load=None)
        load = await self._scrape()
        inflight = await self._inflight() if load is not None else None
        return Probe(healthy=True, load=load, inflight_ids=inflight)

    async def _scrape(self) -> WorkerLoad | None:
        try:
            status, text = await self._get("/metrics")
            if status != 200:
                raise MetricsParseError(f"GET /metrics answered {status}")
            return extract_load(parse_prometheus(text))
        except (aiohttp.ClientError, TimeoutError, MetricsParseError) as e:
            self.counts["scrape_errors"] += 1
            logger.warning("scrape of %s/metrics failed: %s", self.config.base_url, e)
            return None

    async def _inflight(self) -> tuple[str, ...] | None:
        if not self.inflight_supported:
            return None
        try:
            status, text = await self._get(self.config.inflight_path)
            if status == 404:
                self.inflight_supported = False  # real vLLM: report counts only
                logger.info("worker has no %s: reporting counts only", self.config.inflight_path)
                return None
            body: Any = json.loads(text) if status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        if isinstance(body, dict):
            body = body.get("request_ids", body.get("ids", body.get("inflight")))
        return tuple(str(x) for x in body) if isinstance(body, list) else None

    async def worker_models(self) -> list[str]:
        try:
            status, text = await self._get("/v1/models")
            data = json.loads(text).get("data", []) if status == 200 else []
            return sorted({str(m["id"]) for m in data if isinstance(m, dict) and "id" in m})
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as e:
            logger.warning("GET %s/v1/models failed: %s", self.config.base_url, e)
            return []
