"""`KvGate`: the kvgate mitmproxy addon — admit, route and account for LLM requests.

One parent addon owns the process-wide services and the lifecycle; it hands them, as one frozen
`GatewayContext` (context.py), to one part per concern, which run in order on every hook (STYLE §7.3;
the parent calls them itself, see `_wire`), each failing closed:

    Intake     local endpoints, auth, priority, body limits, model pool, prefix hashes   (intake.py)
    Admission  routing choice, global slot lease on that worker, queued across gateways (admit.py)
    Dispatch   upstream rewrite to the chosen worker                                     (dispatch.py)
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
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from plugin.admit import Admission
from plugin.audit import Auditor
from plugin.auth import Auth
from plugin.autoscale import QueueSignalRefresher
from plugin.config import ConfigError, GatewayConfig, load_config
from plugin.context import GatewayContext
from plugin.decision_log import DecisionLog
from plugin.dispatch import Dispatch
from plugin.errors import (
    install_connect_retry,
    install_json_protocol_errors,
    install_oversized_body_drain,
    install_retry_before_first_byte,
    install_sse_error_on_broken_stream,
    openai_error,
)
from plugin.flow import state_of
from plugin.intake import Intake
from plugin.local import LocalEndpoints
from plugin.metrics import GatewayMetrics
from plugin.metrics_server import DEFAULT_METRICS_PORT, MetricsServer
from plugin.mirror import ClusterMirror
from plugin.open_admission import OpenShare
from plugin.prefix_memo import PromptHasher
from plugin.process_state import ProcessState
from plugin.quotas import configured_quota, ensure_quotas
from plugin.release import Release
from plugin.releaser import Releaser
from plugin.routing import Router
from plugin.sessions import SessionAffinity
from plugin.static_workers import StaticWorkers
from plugin.workers import WorkerPool
from policy.pressure import PressureTracker
from runtime.tasks import spawn
from store.connect import redacted, redis_from_url
from store.redis_server import EmbeddedRedis, stable_socket_path
from store.slots import SlotPool

logger = logging.getLogger(__name__)

REDIS_CONNECTIONS = 4096


class KvGate:
    """Admit, route and account for LLM requests; its request-path parts run in order on every hook."""

    def __init__(self) -> None:
        self.config = GatewayConfig()
        self.auth = Auth(self.config)
        self.metrics = GatewayMetrics()
        self.gateway_id = ""
        self.redis: aioredis.Redis | None = None
        self.embedded: EmbeddedRedis | None = None
        self.pool: SlotPool | None = None  # set in running()
        self.releaser: Releaser | None = None
        self._reclaim_task: asyncio.Task[None] | None = None
        self.mirror: ClusterMirror | None = None
        self.router = Router(self.config.routing)
        self.sessions = SessionAffinity(None, self.router.policy_config.session.ttl_s, self.metrics)
        self.hasher = PromptHasher()  # prefix hashes, shared prefixes hashed once (plugin/prefix_memo.py)
        self.decisions = DecisionLog(None)
        self.static: StaticWorkers | None = None
        self.queue_signal: QueueSignalRefresher | None = None  # autoscaling gauges (plugin/autoscale.py)
        self.pressure = PressureTracker()  # sheds low priority under sustained pressure (fed by queue_signal)
        self.auditor: Auditor | None = None  # drift audit (plugin/audit.py)
        self.process = ProcessState()  # draining, requests waiting for admission
        self.workers = WorkerPool(None)
        self.local: LocalEndpoints | None = None
        self.parts: tuple[Intake, Admission, Dispatch, Release] | None = None  # built once running
        self._started = False
        self._quota_task: asyncio.Task[None] | None = None
        self._profiler: cProfile.Profile | None = None
        self.metrics_server: MetricsServer | None = None  # the metrics port (plugin/metrics_server.py)
        self._refresh_task: asyncio.Task[None] | None = None
        self.open_share: OpenShare | None = None  # gateway.redis_failure = "open" (plugin/open_admission.py)

    def _wire(self, pool: SlotPool, releaser: Releaser) -> None:
        """Hand the services to the request-path parts, as one frozen bundle.

        The parts are dispatched by the hooks below rather than registered as mitmproxy child
        addons: each event goes through mitmproxy's ~40-addon dispatch, and four more addons in
        that chain cost measurable CPU per request; the order and the one-concern-per-part split are
        the same."""
        self.local = LocalEndpoints(
            gateway_id=self.gateway_id, redis=self.redis, pool=pool, mirror=self.mirror, router=self.router,
            metrics=self.metrics, process=self.process,
        )  # fmt: skip
        context = GatewayContext(
            gateway_id=self.gateway_id, config=self.config, auth=self.auth, metrics=self.metrics,
            workers=self.workers, router=self.router, hasher=self.hasher, pool=pool, releaser=releaser,
            pressure=self.pressure, decisions=self.decisions, process=self.process, local=self.local,
            sessions=self.sessions, open_share=self.open_share,
        )  # fmt: skip
        dispatch = Dispatch(
            collect_usage=self.config.streaming.collect_usage, metrics=self.metrics,
            upstream_key=self.config.gateway.upstream_key,
        )  # fmt: skip
        self.parts = (Intake(context), Admission(context), dispatch, Release(context))

    @property
    def releases(self) -> int:
        """Leases the flows gave back (queued for the release loop)."""
        return self.releaser.released if self.releaser is not None else 0

    # -- hooks: the parts in order -----------------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        if self.parts is None:  # not running (no Redis): never forward to the fallback upstream
            flow.response = openai_error(503, "starting", "the gateway is not running yet", retry_after_s=1)
            return
        intake, admission, dispatch, _ = self.parts
        await intake.request(flow)
        await admission.request(flow)
        await dispatch.request(flow)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if self.parts is not None:
            self.parts[3].responseheaders(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        if self.parts is not None:
            self.parts[3].response(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        if self.parts is not None:
            self.parts[3].error(flow)

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
            "kvgate_embedded_redis_port", int, 0, "TCP port of the embedded redis-server (0: a free one)."
        )
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
        loader.add_option(
            "kvgate_metrics_port", int, DEFAULT_METRICS_PORT,
            "Port of /metrics, /healthz and /readyz on their own listener (0: none; -1: any free port).",
        )  # fmt: skip
        loader.add_option("kvgate_metrics_host", str, "0.0.0.0", "Address of the metrics port.")

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
        if not install_connect_retry(self.retarget):
            logger.warning("kvgate: a request whose worker refuses the connection is not routed again")
        if not install_sse_error_on_broken_stream():
            logger.warning("kvgate: a stream its worker breaks off ends without an SSE error event")
        if not install_retry_before_first_byte(
            lambda flow: self.retarget(flow, "broke the connection before its first byte")
        ):
            logger.warning("kvgate: a request whose worker breaks before its first byte is not routed again")
        if not install_oversized_body_drain(self.config.limits.max_body_bytes):
            logger.warning("kvgate: an oversized body without Expect: 100-continue may hang its client")
        self.gateway_id = opts.kvgate_gateway_id or f"{socket.gethostname()}-{os.getpid()}"
        url = opts.kvgate_redis_url
        if not url:
            # a stable address across restarts of this gateway, so its agents find the new server
            name = opts.kvgate_gateway_id or f"port-{opts.listen_port}"
            port = opts.kvgate_embedded_redis_port or None
            self.embedded = EmbeddedRedis(port, unix_socket=stable_socket_path(name)).start()
            url = self.embedded.url
            logger.info("kvgate: embedded redis-server at %s and %s", url, self.embedded.unix_url)
        # redis-py's default pool raises MaxConnectionsError past 100 concurrent commands, which a
        # burst of queued requests reaches; its blocking pool costs more per command, so: a high cap
        timeout_s = self.config.gateway.redis_timeout_ms / 1000
        self.redis = redis_from_url(
            url, max_connections=REDIS_CONNECTIONS, socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,  # also the admission fast path's (store/resp.py); > the index XREAD
            # after a Redis restart every pooled connection is stale: a command that finds its
            # connection closed reconnects and is sent again (the scripts are idempotent per id)
            retry=Retry(NoBackoff(), 2), retry_on_error=[RedisConnectionError],
        )  # fmt: skip
        secret = self.config.gateway.worker_secret_bytes()
        if not secret:
            logger.warning(
                "kvgate: no worker secret (gateway.worker_secret / KVGATE_WORKER_SECRET): anyone who can "
                "write to Redis can register a worker (docs/SECURITY.md)"
            )
        try:
            await asyncio.wait_for(self.redis.ping(), 5.0)
        except (RedisError, OSError, TimeoutError) as e:
            # an error logged during startup makes mitmproxy exit with status 1 (errorcheck addon)
            logger.error("kvgate: cannot reach Redis at %s: %s", redacted(url), e)
            return
        config = self.config
        self.pool = SlotPool(
            self.redis, gateway_id=self.gateway_id, lease_ms=config.admission.lease_ms,
            renew_every_ms=config.admission.renew_every_ms, on_quota_missing=self._quota_missing,
        )  # fmt: skip
        await self.pool.start()
        self.releaser = Releaser(self.pool)
        await self.releaser.start()
        self.router = Router(
            config.routing,
            self.redis,
            prefix_modes=config.prefix_modes(),
            metrics=self.metrics,
            tokenizers=config.tokenizers(),
        )
        await self.router.start()
        self.sessions = SessionAffinity(self.redis, self.router.policy_config.session.ttl_s, self.metrics)
        await self.sessions.start()
        self.decisions = DecisionLog(
            self.redis if config.decision_log.redis_stream else None,
            maxlen=config.decision_log.stream_maxlen,
            to_log=config.decision_log.log,
            file=config.decision_log.file,
            file_max_bytes=config.decision_log.file_max_mb << 20,
        )
        await self.decisions.start()
        if opts.kvgate_workers:
            self.static = StaticWorkers(
                self.redis, list(opts.kvgate_workers), model=opts.kvgate_model,
                max_concurrency=opts.kvgate_worker_max_concurrency, secret=secret,
            )  # fmt: skip
            await self.static.start()
        self.mirror = ClusterMirror(
            self.redis, refresh_ms=config.routing.refresh_ms,
            on_index_ops=self.router.apply_index_ops, on_worker_reset=self.router.reset_worker,
            on_refresh=self._on_refresh, secret=secret,
        )  # fmt: skip
        await self.mirror.start()
        self.workers = WorkerPool(self.mirror)
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
        if config.gateway.redis_failure == "open":
            self.open_share = OpenShare(
                self.redis, self.pool, gateway_id=self.gateway_id, period_s=config.routing.refresh_ms / 1000,
                models=lambda: [*(self.mirror.models() if self.mirror else ()), *config.models],
                configured_total=self._configured_total,
            )  # fmt: skip
            await self.open_share.start()
        self._wire(self.pool, self.releaser)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_sigterm)
        logger.info("kvgate: gateway %s running (policy %s)", self.gateway_id, config.routing.policy)
        if isinstance(ctx.master, DumpMaster):  # a gateway process (not a test harness's master)
            self._start_metrics_port(opts.kvgate_metrics_host, opts.kvgate_metrics_port)
            # everything built so far (mitmproxy, kvgate, config) lives as long as the process: take it
            # out of the cyclic GC's scans (measured: GC 7% -> 4% of gateway CPU at saturation)
            gc.freeze()
        if os.environ.get("KVGATE_PROFILE"):
            self._profiler = cProfile.Profile()
            self._profiler.enable()

    def _start_metrics_port(self, host: str, port: int) -> None:
        assert self.local is not None
        if port == 0:
            return
        try:
            self.metrics_server = MetricsServer(
                self.metrics.registry, self.local.readiness, host, max(port, 0)
            ).start()
        except OSError as e:  # a warning, not an error: mitmproxy exits on an error logged at start
            logger.warning("kvgate: metrics port %s:%s not opened (%s); no /metrics or /healthz",
                           host, port, e)  # fmt: skip
            return
        self._refresh_task = spawn(self.local.refresh_forever(1.0), name="kvgate-metrics-refresh")
        logger.info("kvgate: metrics port listening on http://%s:%s (/metrics, /healthz, /readyz)",
                    host, self.metrics_server.port)  # fmt: skip

    async def done(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            self._refresh_task = None
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        if self.open_share is not None:
            await self.open_share.leave()
        parts = (
            self.open_share,
            self.queue_signal,
            self.auditor,
            self.mirror,
            self.static,
            self.router,
            self.sessions,
            self.decisions,
        )
        for part in parts:
            if part is not None:
                with contextlib.suppress(Exception):
                    await part.close()
        if self.pool is not None:
            with contextlib.suppress(Exception):
                if self.releaser is not None:
                    await self.releaser.close()  # sends what the flows gave back last
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
        """Re-assert the configured quotas after every mirror refresh (one in flight at a time)."""
        if self.redis is None or self.mirror is None:
            return
        if self._quota_task is None or self._quota_task.done():
            self._quota_task = spawn(self._ensure_quotas(models), name="kvgate-ensure-quotas")

    def _configured_total(self, model: str) -> int | None:
        """The total this gateway would write for `model` (None = unlimited)."""
        if self.mirror is None:
            return None
        return configured_quota(self.config, self.mirror, model).total

    async def _quota_missing(self, model: str) -> None:
        """An acquire found `model`'s quota hash gone: write the configured one now."""
        await self._ensure_quotas([model])

    async def _ensure_quotas(self, models: Sequence[str]) -> None:
        if self.redis is None or self.mirror is None:
            return
        admission = self.config.admission
        await ensure_quotas(
            self.redis, self.config, self.mirror, models, self.gateway_id,
            # long enough for every gateway to renew (and so reclaim) its leases once, with one retry
            recover_ms=min(admission.lease_ms, 2 * admission.renew_every_ms),
            on_rewritten=self._quota_rewritten,
        )  # fmt: skip

    def _quota_rewritten(self, model: str) -> None:
        """Redis lost `model`'s leases (its quota was written again): take this gateway's back now
        rather than at the next renewal."""
        if self.pool is not None and (self._reclaim_task is None or self._reclaim_task.done()):
            self._reclaim_task = spawn(self._reclaim(self.pool), name="kvgate-reclaim-leases")

    @staticmethod
    async def _reclaim(pool: SlotPool) -> None:
        try:
            await pool.renew_now()
        except (RedisError, OSError) as e:  # the periodic renewal tries again
            logger.warning("kvgate: taking leases back after a Redis restart failed: %s", e)

    def retarget(self, flow: http.HTTPFlow, why: str = "refused the connection") -> bool:
        """The flow's worker refused the connection, or broke it before its first response byte
        (nothing reached the client): point the flow at the routing choice among the other routable
        workers. This gateway's in-flight count moves with it; its lease stays as placed (released
        once, as placed, so the old worker's seat count in Redis comes back exactly)."""
        state = state_of(flow)
        if state is None or state.route is None or state.parsed is None or state.caller is None:
            return False
        old = state.route
        self.workers.suspect(old)
        others = [w for w in self.workers.routable(old.model) if w.id != old.worker.id]
        if state.prompt is None or not others:
            return False
        route = self.router.choose(
            request_id=state.request_id, model=old.model, prompt=state.prompt,
            max_tokens=state.parsed.max_tokens, band=state.caller.band, tenant=state.caller.tenant,
            workers=others, session=state.session.binding if state.session is not None else None,
            streamed=state.parsed.stream,
        )  # fmt: skip
        if route is None:
            return False
        self.router.finished(old)
        self.router.reserve(route)
        state.route = route
        if state.session is not None:
            self.sessions.rerouted(route, state.session)
        up = route.upstream
        flow.request.scheme, flow.request.data.host, flow.request.port = up.scheme, up.host, up.port
        self.metrics.retried.inc(old.model, old.worker.id)
        logger.info("request %s: worker %s %s; routed to %s",
                    state.request_id, old.worker.id, why, route.worker.id)  # fmt: skip
        return True

    # -- client disconnects while queued -------------------------------------------------------------
    def client_disconnected(self, client: connection.Client) -> None:
        self.process.client_left(client.id)  # plugin/admit.py takes this cancellation back

    # -- SIGTERM drain -------------------------------------------------------------------------------
    def _on_sigterm(self) -> None:
        if not self.process.draining:
            spawn(self.drain(), name="kvgate-drain")

    async def drain(self) -> None:
        """Refuse new requests, let live ones finish (bounded), then shut mitmproxy down."""
        self.process.draining = True
        deadline = time.monotonic() + self.config.gateway.drain_timeout_ms / 1000
        logger.info("kvgate: draining (%d requests in flight)", self.inflight())
        while self.inflight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        logger.info("kvgate: drained; %d requests still in flight", self.inflight())
        ctx.master.shutdown()

    def inflight(self) -> int:
        return (
            sum(sum(r.inflight.values()) for r in self.router.models.values()) + self.process.queued_total()
        )
