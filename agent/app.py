"""The node agent process: probes one worker, keeps its registry lease, publishes its cache summary.

Every heartbeat period `WorkerAgent.step` probes the worker (agent/probe.py: GET /health, /metrics,
and /kvgate/inflight when the worker offers it), asks `LeaseKeeper` (agent/lease.py) what to do, and does
it against Redis (store/registry.py, store/index_store.py). In exact mode a `KvEventConsumer`
(agent/kv_events.py) turns the worker's KV events into index entries. The agent serves its own
GET /healthz and GET /metrics (Prometheus text). `create_app(config)` builds the aiohttp app; Redis,
the HTTP client, the lease loop and the KV-event consumer live in `cleanup_ctx` contexts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agent.config import AgentConfig
from agent.kv_consumer import KvEventConsumer, KvEventStats
from agent.lease import LeaseKeeper, Probe
from agent.probe import WorkerProbe
from agent.scrape import WorkerLoad
from policy.worker_auth import secret_from_env
from runtime.exposition import text_of
from runtime.tasks import cancel_and_wait, spawn
from store import index_store, registry
from store.connect import redis_from_url
from store.registry import WorkerRecord

logger = logging.getLogger("kvgate.agent")


def wall_ms() -> int:
    return int(time.time() * 1000)


class WorkerAgent:
    """Imperative shell around `LeaseKeeper`: probe the worker, then register / heartbeat / drain."""

    def __init__(
        self,
        config: AgentConfig,
        redis: aioredis.Redis,
        session: aiohttp.ClientSession,
        clock_ms: Callable[[], int] = wall_ms,
    ) -> None:
        self.config = config
        self.redis = redis
        self.secret = secret_from_env()  # signs registrations and heartbeats (policy/worker_auth.py)
        self.session = session
        self.clock_ms = clock_ms
        self.keeper = LeaseKeeper(
            fail_periods=config.fail_periods, drain_quiet_periods=config.drain_quiet_periods
        )
        self.prober = WorkerProbe(config, session)
        self.models: list[str] = [config.model] if config.model else []
        self.served: list[str] | None = None  # the worker's /v1/models, once read
        self.epochs: dict[str, int] = {}
        self.counts: Counter[str] = Counter()
        self.consumer: KvEventConsumer | None = None
        self._consumer_task: asyncio.Task[None] | None = None
        self.done = asyncio.Event()  # set when the agent has finished (drained, or stopped)
        self.exit_code = 0

    # --- one heartbeat period ---

    async def probe(self) -> Probe:
        """Probe the worker; on first success, learn (or check --model against) the models it serves."""
        probe = await self.prober.probe()
        if probe.load is not None and self.served is None:
            self.served = await self.prober.worker_models()
            if not self.models:
                self.models = list(self.served)
            elif self.served and self.config.model not in self.served:
                logger.warning("worker %s does not list --model %s in /v1/models (it serves %s)",
                               self.config.base_url, self.config.model, ", ".join(self.served))  # fmt: skip
            if not self.models:
                self.served = None  # try again next period
                return Probe(healthy=False, load=None)  # cannot register a worker that serves nothing
        return probe

    async def step(self) -> None:
        """Probe once and carry out what the lease keeper decides."""
        probe = await self.probe()
        restarts = self.keeper.restarts
        actions = self.keeper.observe(probe)
        if self.keeper.restarts > restarts:
            logger.warning("worker %s restarted (%s): new epoch, index cleared",
                           self.config.id, self.keeper.last_restart_reason)  # fmt: skip
        for action in actions:
            if action == "register":
                await self.register()
            elif action == "clear_index":
                await self.clear_index()
            elif action == "heartbeat":
                await self.heartbeat()
            elif action == "suspend":
                self.counts["suspensions"] += 1
                logger.warning("worker %s failed %d probes: no longer renewing its lease",
                               self.config.id, self.keeper.failures)  # fmt: skip
            elif action == "finish":
                await self.finish("drained: no requests left")

    def _record(self, model: str) -> WorkerRecord:
        load = self.keeper.last_load or WorkerLoad(engine="unknown")
        return WorkerRecord(
            id=self.config.id,
            model=model,
            url=self.config.base_url,
            models=(model,),
            max_concurrency=self.config.max_concurrency,
            capacity_tokens=load.capacity_tokens,
            block_size=load.block_size,
            num_gpu_blocks=load.num_gpu_blocks,
            router_block_size=self.router_block_size() if self.config.kv_events else 0,
            running=load.running,
            waiting=load.waiting,
            kv_usage=load.kv_usage,
            draining=self.keeper.draining,
            inflight_ids=self.keeper.last_inflight,
        )

    async def register(self) -> None:
        now = self.clock_ms()
        for model in self.models:
            self.epochs[model] = await registry.register(
                self.redis, self._record(model), self.config.lease_ms, now, self.secret
            )
        self.keeper.registered_now()
        self.counts["registrations"] += 1
        logger.info("registered worker %s (%s) for %s, epoch %s",
                    self.config.id, self.config.base_url, ", ".join(self.models), self.epochs)  # fmt: skip
        if self.config.kv_events and self._consumer_task is None:
            self._start_kv_events()

    async def heartbeat(self) -> None:
        load = self.keeper.last_load or WorkerLoad(engine="unknown")
        draining: bool | None = False
        for model in self.models:
            reply = await registry.heartbeat(
                self.redis,
                model,
                self.config.id,
                running=load.running,
                waiting=load.waiting,
                kv_usage=load.kv_usage,
                inflight_ids=self.keeper.last_inflight,
                lease_ms=self.config.lease_ms,
                now_ms=self.clock_ms(),
                url=self.config.base_url,
                secret=self.secret,
            )
            draining = None if reply is None or draining is None else draining or reply
        self.counts["heartbeats"] += 1
        self.keeper.heartbeat_reply(draining)
        if draining is None:  # pruned or deregistered meanwhile: come back at once
            logger.warning("worker %s was not registered any more: registering again", self.config.id)
            await self.register()
            await self.clear_index()

    async def clear_index(self) -> None:
        if self.consumer is not None:
            self.consumer.forget()
        for model in self.models:
            await index_store.clear_worker(self.redis, model, self.config.id)

    async def finish(self, why: str, exit_code: int = 0) -> None:
        """Deregister the worker (it gets no new requests) and drop its index entries."""
        for model in self.models:
            await registry.deregister(self.redis, model, self.config.id)
            await index_store.clear_worker(self.redis, model, self.config.id)
        logger.info("worker %s deregistered: %s", self.config.id, why)
        self.exit_code = exit_code
        self.done.set()

    async def run(self) -> None:
        """Step every heartbeat period until done; Redis errors are counted and retried next period."""
        period_s = self.config.heartbeat_ms / 1000
        while not self.done.is_set():
            started = time.monotonic()
            try:
                await self.step()
            except (aioredis.RedisError, OSError) as e:
                self.counts["redis_errors"] += 1
                logger.warning("agent step failed: %s", e)
            except registry.RegistrationRefused as e:
                self.counts["registrations_refused"] += 1
                logger.error("registration refused: %s (retrying next period)", e)
            except Exception:
                # a bug: exit non-zero (a supervisor restarts the agent) and let the lease expire
                logger.exception("agent step crashed; exiting")
                self.exit_code = 1
                self.done.set()
            remaining = period_s - (time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), max(remaining, 0.0))

    # --- exact mode ---

    def router_block_size(self) -> int:
        """The configured router block size, or (0) the worker's block size from its metrics; fixed once
        the KV-event consumer has started, since its keys depend on it."""
        if self.consumer is not None:
            return self.consumer.keys.block_size
        load = self.keeper.last_load
        return self.config.router_block_size or (load.block_size if load and load.block_size > 0 else 16)

    def _capacity_blocks(self) -> int:
        """The bound of this worker's index entries: its KV capacity in router blocks, at most
        --index-max-blocks (0 = unknown when neither is known: the store's default)."""
        load = self.keeper.last_load
        capacity = load.capacity_tokens // self.router_block_size() if load else 0
        bound = self.config.index_max_blocks
        return min(capacity, bound) if capacity and bound else capacity or bound

    async def _on_kv_reset(self, reason: str) -> None:
        for model in self.models:
            self.epochs[model] = await registry.bump_epoch(self.redis, model, self.config.id)
        self.counts["cache_resets"] += 1
        logger.warning("worker %s cache reset (%s): new epoch %s", self.config.id, reason, self.epochs)

    def _start_kv_events(self) -> None:
        if self.config.kv_events is None:
            return
        self.consumer = KvEventConsumer(
            self.redis,
            endpoint=self.config.kv_events,
            model=self.models[0],
            worker_id=self.config.id,
            router_block_size=self.router_block_size(),
            capacity_blocks=self._capacity_blocks,
            on_reset=self._on_kv_reset,
            clock_ms=self.clock_ms,
            replay_endpoint=self.config.kv_events_replay,
            dp_size=self.config.kv_events_dp_size,
            adapters=self.models[1:],
            idle_probe_s=self.config.heartbeat_ms / 2000,  # a lost tail batch is back within a heartbeat
        )
        self._consumer_task = spawn(self.consumer.run(), name=f"kv-events-{self.config.id}")

    async def close(self) -> None:
        await cancel_and_wait(self._consumer_task)

    def metrics_text(self) -> str:
        load = self.keeper.last_load or WorkerLoad(engine="unknown")
        kv = self.consumer.stats if self.consumer else KvEventStats()
        unknown_parents = self.consumer.keys.unknown_parents if self.consumer else 0
        rows: list[tuple[str, str, float, str]] = [
            ("heartbeats_total", "counter", self.counts["heartbeats"], "Lease renewals sent."),
            ("registrations_total", "counter", self.counts["registrations"], "Registrations (new epochs)."),
            ("probe_errors_total", "counter", self.prober.counts["probe_errors"], "Failed /health probes."),
            ("scrape_errors_total", "counter", self.prober.counts["scrape_errors"], "Failed scrapes."),
            ("redis_errors_total", "counter", self.counts["redis_errors"], "Failed Redis calls."),
            ("worker_restarts_total", "counter", self.keeper.restarts, "Worker restarts detected."),
            ("cache_resets_total", "counter", self.counts["cache_resets"], "Worker cache clears seen."),
            ("lease_renewing", "gauge", int(self.keeper.renewing), "1 while the lease is renewed."),
            ("draining", "gauge", int(self.keeper.draining), "1 while the worker is draining."),
            ("worker_running", "gauge", load.running, "Requests the worker runs."),
            ("worker_waiting", "gauge", load.waiting, "Requests queued in the worker."),
            ("worker_kv_usage", "gauge", load.kv_usage, "Worker KV-cache usage, 0..1."),
            ("kv_batches_total", "counter", kv.batches, "KV-event batches received."),
            ("kv_events_total", "counter", kv.events, "KV events received."),
            ("kv_seq_gaps_total", "counter", kv.seq_gaps, "KV-event sequence gaps."),
            ("kv_missed_batches_total", "counter", kv.missed_batches, "KV-event batches lost in gaps."),
            ("kv_decode_errors_total", "counter", kv.decode_errors, "Undecodable KV-event messages."),
            ("kv_write_errors_total", "counter", kv.write_errors, "KV-event batches not written to Redis."),
            ("kv_replays_total", "counter", kv.replays, "KV-event gaps filled from the replay socket."),
            ("kv_tail_probe_recoveries_total", "counter", kv.tail_probes_found,
             "Idle probes of the replay socket that found lost tail batches (no later batch showed a gap)."),
            ("kv_replay_failures_total", "counter", kv.replay_failures,
             "KV-event gaps the replay could not fill (the index was reset)."),
            ("kv_last_recovery_seconds", "gauge", kv.last_recovery_s,
             "Time from the last KV-event gap to a whole index again."),
            ("kv_unknown_parent_blocks_total", "counter", unknown_parents,
             "Stored blocks skipped: their parent was stored before the agent subscribed."),
        ]  # fmt: skip
        families = []
        for name, kind, value, help_text in rows:
            family_of = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_of(f"kvgate_agent_{name}", help_text, labels=["worker"])
            family.add_metric([self.config.id], value)
            families.append(family)
        return text_of(families)


CONFIG = web.AppKey("config", AgentConfig)
AGENT = web.AppKey("agent", WorkerAgent)


async def _agent_context(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    redis = redis_from_url(config.redis_url)
    session = aiohttp.ClientSession()
    agent = WorkerAgent(config, redis, session)
    app[AGENT] = agent
    loop_task = spawn(agent.run(), name=f"agent-{config.id}")
    try:
        yield
    finally:
        await cancel_and_wait(loop_task)
        await agent.close()
        await session.close()
        await redis.aclose()


async def healthz(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    body = {
        "worker": agent.config.id,
        "models": agent.models,
        "registered": agent.keeper.registered,
        "renewing": agent.keeper.renewing,
        "draining": agent.keeper.draining,
        "epochs": agent.epochs,
    }
    ok = agent.keeper.registered and agent.keeper.renewing
    return web.json_response(body, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[AGENT].metrics_text(), content_type="text/plain", charset="utf-8")


def create_app(config: AgentConfig) -> web.Application:
    app = web.Application()
    app[CONFIG] = config
    app.cleanup_ctx.append(_agent_context)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
