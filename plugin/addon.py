"""`KvGate`: the kvgate mitmproxy addon — admit, route and account for LLM requests.

One parent addon owns the process-wide parts and the lifecycle; one child per concern runs in order
on every hook (STYLE §7.3; the parent calls them itself, see __init__), each failing closed:

    Intake     local endpoints, auth, priority, body limits, model pool, prefix hashes   (intake.py)
    Admission  global slot lease, queued in priority order across gateways              (admit.py)
    Dispatch   routing decision from in-memory state, upstream rewrite                 (routing.py)
    Release    metered streaming, x-kvgate-* headers, release exactly once, record     (release.py)

Options (per-process knobs; everything else is the TOML file, plugin/config.py):
    kvgate_config     path of the TOML config ("" = defaults)
    kvgate_redis_url  redis://... ("" = start a private embedded redis-server)
    kvgate_gateway_id name in leases and decision records ("" = host-pid)
    kvgate_workers    static worker URLs (no agent): registered and health-checked by this process
    kvgate_model      model name of the static workers ("" = ask each worker's /v1/models)
    kvgate_worker_max_concurrency  per static worker (0 = unknown)
On SIGTERM the gateway drains: new requests get 503, live streams finish (bounded by
gateway.drain_timeout_ms), then mitmproxy shuts down (MITMPROXY.md §5).
Profiling: with the environment variable KVGATE_PROFILE=PATH the process runs under cProfile from
start to shutdown and writes its stats to PATH (read them with `python -m pstats PATH`).
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.tools.dump import DumpMaster
from redis.exceptions import RedisError

from agent.registry import WorkerRecord
from plugin.admit import Admission
from plugin.audit import Auditor
from plugin.auth import Auth
from plugin.autoscale import QueueSignalRefresher
from plugin.config import ConfigError, GatewayConfig, load_config
from plugin.decision_log import DecisionLog
from plugin.errors import install_json_protocol_errors, json_response
from plugin.intake import Intake
from plugin.metrics import GatewayMetrics
from plugin.mirror import ClusterMirror, wall_ms
from plugin.prefix_memo import PromptHasher
from plugin.quotas import ensure_quotas
from plugin.redis_server import EmbeddedRedis
from plugin.release import Release
from plugin.routing import Dispatch, Route, Router
from plugin.slots import Lease, SlotPool
from plugin.static_workers import StaticWorkers
from plugin.tasks import cancel_and_wait, spawn
from policy.pressure import PressureTracker

logger = logging.getLogger(__name__)

REDIS_CONNECTIONS = 4096
SUSPECT_S = 5.0  # a worker that refused a connection is skipped this long (unless it is the only one)


class KvGate:
    """Admit, route and account for LLM requests; children run in order on every hook."""

    def __init__(self) -> None:
        self.config = GatewayConfig()
        self.auth = Auth(self.config)
        self.metrics = GatewayMetrics()
        self.gateway_id = ""
        self.redis: aioredis.Redis | None = None
        self.embedded: EmbeddedRedis | None = None
        self.pool: SlotPool = None  # set in running()
        self.mirror: ClusterMirror | None = None
        self.router = Router(self.config.routing)
        self.hasher = PromptHasher()  # prefix hashes, shared prefixes hashed once (plugin/prefix_memo.py)
        self.decisions = DecisionLog(None)
        self.static: StaticWorkers | None = None
        self.queue_signal: QueueSignalRefresher | None = None  # autoscaling gauges (plugin/autoscale.py)
        self.pressure = PressureTracker()  # sheds low priority under sustained pressure (fed by queue_signal)
        self.auditor: Auditor | None = None  # drift audit (plugin/audit.py)
        self.draining = False
        self.waiters: dict[str, set[asyncio.Task[Any]]] = {}  # client id -> its hooks awaiting admission
        self.disconnected: set[asyncio.Task[Any]] = set()  # of those, cancelled because the client left
        self.queued: dict[str, int] = {}  # model -> requests of this process waiting for a slot
        self.suspects: dict[tuple[str, str], float] = {}  # (model, worker) -> skip until (monotonic)
        self.releases = 0
        self._to_release: list[Lease] = []  # released by the flows, not yet sent (_release_loop)
        self._release_wake = asyncio.Event()
        self._releaser: asyncio.Task[None] | None = None
        self._started = False
        self._profiler: cProfile.Profile | None = None
        # The children are dispatched by the hooks below rather than registered as mitmproxy child
        # addons: each event goes through mitmproxy's ~40-addon dispatch, and four more addons in
        # that chain cost measurable CPU per request; the order and the one-concern-per-child
        # split are the same.
        self.intake, self.admission = Intake(self), Admission(self)
        self.dispatch, self.release = Dispatch(self), Release(self)

    # -- hooks: the children in order --------------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        await self.intake.request(flow)
        await self.admission.request(flow)
        await self.dispatch.request(flow)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self.release.responseheaders(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self.release.response(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.release.error(flow)

    # -- options and config --------------------------------------------------------------------------
    def load(self, loader: Any) -> None:
        loader.add_option("kvgate_config", str, "", "Path of the kvgate TOML config (empty: defaults).")
        loader.add_option(
            "kvgate_redis_url",
            str,
            "",
            "Redis URL shared by all gateways (empty: start an embedded redis-server).",
        )
        loader.add_option("kvgate_gateway_id", str, "", "This gateway's name (empty: hostname-pid).")
        loader.add_option(
            "kvgate_workers",
            Sequence[str],
            [],
            "Static worker URLs (no agent); registered and health-checked here.",
        )
        loader.add_option(
            "kvgate_model", str, "", "Model of the static workers (empty: ask their /v1/models)."
        )
        loader.add_option(
            "kvgate_worker_max_concurrency", int, 0, "Concurrency of each static worker (0: unknown)."
        )

    def configure(self, updated: set[str]) -> None:
        if "kvgate_config" in updated:
            if self._started:
                raise exceptions.OptionsError(
                    "kvgate_config cannot change while running; restart the gateway"
                )
            try:
                self.config = load_config(ctx.options.kvgate_config)
            except ConfigError as e:
                raise exceptions.OptionsError(f"kvgate config: {e}") from e
            self.auth = Auth(self.config)

    # -- lifecycle -----------------------------------------------------------------------------------
    async def running(self) -> None:
        if self._started:
            return
        self._started = True
        opts = ctx.options
        if not install_json_protocol_errors():
            logger.warning("kvgate: mitmproxy's own error pages stay HTML in this version")
        self.gateway_id = opts.kvgate_gateway_id or f"{socket.gethostname()}-{os.getpid()}"
        url = opts.kvgate_redis_url
        if not url:
            self.embedded = EmbeddedRedis().start()
            url = self.embedded.url
            logger.info("kvgate: embedded redis-server at %s", url)
        # redis-py's default pool raises MaxConnectionsError past 100 concurrent commands, which a
        # burst of queued requests reaches; its blocking pool costs more per command, so: a high cap
        self.redis = aioredis.Redis.from_url(url, max_connections=REDIS_CONNECTIONS)
        try:
            await asyncio.wait_for(self.redis.ping(), 5.0)
        except (RedisError, OSError, TimeoutError) as e:
            # an error logged during startup makes mitmproxy exit with status 1 (errorcheck addon)
            logger.error("kvgate: cannot reach Redis at %s: %s", url, e)
            return
        config = self.config
        self.pool = SlotPool(
            self.redis, gateway_id=self.gateway_id, lease_ms=config.admission.lease_ms,
            renew_every_ms=config.admission.renew_every_ms,
        )  # fmt: skip
        await self.pool.start()
        self._releaser = spawn(self._release_loop(), name="kvgate-release")
        self.router = Router(
            config.routing,
            self.redis,
            prefix_modes=config.prefix_modes(),
            metrics=self.metrics,
            tokenizers=config.tokenizers(),
        )
        await self.router.start()
        self.decisions = DecisionLog(
            self.redis if config.decision_log.redis_stream else None,
            maxlen=config.decision_log.stream_maxlen,
            to_log=config.decision_log.log,
        )
        await self.decisions.start()
        if opts.kvgate_workers:
            self.static = StaticWorkers(
                self.redis, list(opts.kvgate_workers), model=opts.kvgate_model,
                max_concurrency=opts.kvgate_worker_max_concurrency,
            )  # fmt: skip
            await self.static.start()
        self.mirror = ClusterMirror(
            self.redis, refresh_ms=config.routing.refresh_ms,
            on_index_ops=self.router.apply_index_ops, on_worker_reset=self.router.reset_worker,
            on_refresh=self._on_refresh,
        )  # fmt: skip
        await self.mirror.start()
        self.queue_signal = QueueSignalRefresher(
            self.pool, self.metrics, self.mirror.models, pressure=self.pressure
        )
        await self.queue_signal.start()
        if config.admission.audit_every_ms:
            self.auditor = Auditor(
                self.redis, self.metrics, gateway_id=self.gateway_id, models=self.mirror.models,
                period_s=config.admission.audit_every_ms / 1000, threshold=config.admission.drift_warn,
            )  # fmt: skip
            await self.auditor.start()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_sigterm)
        logger.info("kvgate: gateway %s running (policy %s)", self.gateway_id, config.routing.policy)
        if isinstance(ctx.master, DumpMaster):  # a gateway process (not a test harness's master)
            # everything built so far (mitmproxy, kvgate, config) lives as long as the process: take it
            # out of the cyclic GC's scans (measured: GC 7% -> 4% of gateway CPU at saturation)
            gc.freeze()
        if os.environ.get("KVGATE_PROFILE"):
            self._profiler = cProfile.Profile()
            self._profiler.enable()

    async def done(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        for part in (self.queue_signal, self.auditor, self.mirror, self.static, self.router, self.decisions):
            if part is not None:
                with contextlib.suppress(Exception):
                    await part.close()
        if self.pool is not None:
            await cancel_and_wait(self._releaser)
            self._releaser = None
            with contextlib.suppress(Exception):
                await self._release_queued()  # what the flows gave back last
                await self.pool.close()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.aclose()
        if self.embedded is not None:
            self.embedded.stop()
            self.embedded = None
        if self._profiler is not None:
            self._profiler.disable()
            self._profiler.dump_stats(os.environ["KVGATE_PROFILE"])
            self._profiler = None
        self._started = False

    def _on_refresh(self, models: Sequence[str]) -> None:
        if self.redis is not None and self.mirror is not None:
            spawn(ensure_quotas(self.redis, self.config, self.mirror, models), name="kvgate-ensure-quotas")

    # -- client disconnects while queued -------------------------------------------------------------
    def client_disconnected(self, client: connection.Client) -> None:
        for task in self.waiters.pop(client.id, ()):
            self.disconnected.add(task)  # plugin/admit.py takes this cancellation back
            task.cancel()

    # -- shared helpers for the children -------------------------------------------------------------
    def mirror_workers(self, model: str) -> list[WorkerRecord]:
        return self.mirror.workers(model) if self.mirror else []

    def routable(self, model: str) -> list[WorkerRecord]:
        """Live, non-draining workers of `model`, minus recently refused ones (unless none would be left)."""
        if self.mirror is None:
            return []
        workers = self.mirror.routable(model)
        if self.suspects:
            now = time.monotonic()
            ok = [w for w in workers if self.suspects.get((model, w.id), 0.0) <= now]
            return ok or workers
        return workers

    def router_suspect(self, route: Route) -> None:
        self.suspects[(route.model, route.worker.id)] = time.monotonic() + SUSPECT_S

    def release_lease(self, lease: Lease) -> None:
        """Give `lease` back soon: queued for the release loop, which sends what one loop tick queued
        in one pipelined round trip (no task per request)."""
        self.releases += 1
        if not self._to_release:
            self._release_wake.set()
        self._to_release.append(lease)
        if self._releaser is None:  # no release loop (stopping): send it now
            spawn(self._release_queued(), name="kvgate-release-late")

    async def _release_loop(self) -> None:
        while True:
            await self._release_wake.wait()
            self._release_wake.clear()
            await self._release_queued()

    async def _release_queued(self) -> None:
        batch, self._to_release = self._to_release, []
        if not batch:
            return
        try:
            await self.pool.release_many(batch)
        except (RedisError, OSError) as e:  # the leases expire on their own
            logger.warning("release of %d leases failed: %s", len(batch), e)

    # -- local endpoints -----------------------------------------------------------------------------
    async def serve_local(self, endpoint: str) -> http.Response:
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
        ok = redis_ok and live > 0 and not self.draining
        body = {"status": "ok" if ok else "unavailable", "redis": redis_ok, "live_workers": live,
                "draining": self.draining, "gateway": self.gateway_id}  # fmt: skip
        return json_response(200 if ok else 503, body)

    async def render_metrics(self) -> str:
        m = self.metrics
        m.draining.set(1.0 if self.draining else 0.0)
        for model, n in self.queued.items():
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

    # -- SIGTERM drain -------------------------------------------------------------------------------
    def _on_sigterm(self) -> None:
        if not self.draining:
            spawn(self.drain(), name="kvgate-drain")

    async def drain(self) -> None:
        """Refuse new requests, let live ones finish (bounded), then shut mitmproxy down."""
        self.draining = True
        deadline = time.monotonic() + self.config.gateway.drain_timeout_ms / 1000
        logger.info("kvgate: draining (%d requests in flight)", self.inflight())
        while self.inflight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        logger.info("kvgate: drained; %d requests still in flight", self.inflight())
        ctx.master.shutdown()

    def inflight(self) -> int:
        return sum(sum(r.inflight.values()) for r in self.router.models.values()) + sum(self.queued.values())
