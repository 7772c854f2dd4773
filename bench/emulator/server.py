"""The emulated vLLM worker's HTTP server (aiohttp): what a router, an agent or a client talks to.

Endpoints, as vLLM serves them: POST /v1/chat/completions and /v1/completions (SSE when `stream`),
GET /v1/models, GET /health, GET /version, POST /tokenize, POST /v1/chat/completions/render and
/v1/completions/render, GET /metrics, POST /reset_prefix_cache;
plus GET /kvgate/inflight (ids of the requests held now, from X-Request-Id, for agent
reconciliation). A request's prompt becomes engine blocks keyed by the chained block keys
(bench/emulator/tokenizer.py); the engine (bench/sim/engine.py, via driver.py) decides when its first
token comes, how much of it was cached, and how fast it decodes.
A client that disconnects aborts its request in the engine (handler cancellation is on).
This module assembles the app and runs it; the handlers are in completions.py and endpoints.py, the
per-server state in worker.py.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import AsyncIterator

from aiohttp import web

from bench.emulator import engine_tokenizer
from bench.emulator.completions import completion_handler
from bench.emulator.driver import EngineDriver
from bench.emulator.endpoints import (
    health,
    held_log,
    inflight,
    json_not_found,
    kv_faults,
    list_models,
    metrics_endpoint,
    render_endpoint,
    reset_prefix_cache,
    tokenize_endpoint,
    version,
)
from bench.emulator.kv_events import (
    BlockCatalog,
    EngineKvEvent,
    KvEventPublisher,
    default_topic,
    to_vllm_events,
)
from bench.emulator.metrics import RequestMetrics
from bench.emulator.worker import MAX_BODY_BYTES, WORKER, WORKER_CONFIG, EmulatorConfig, Worker
from bench.sim.engine import Engine
from runtime.tasks import cancel_and_wait, spawn

# EmulatorConfig is re-exported: callers build a config and start a server from this one module
__all__ = ["EmulatorConfig", "create_app", "start_emulator", "worker_of"]

logger = logging.getLogger(__name__)


async def engine_context(app: web.Application) -> AsyncIterator[None]:
    """Engine, KV-event publisher and the driver task for the server's lifetime."""
    config = app[WORKER_CONFIG]
    profile = config.engine_profile()
    publisher = catalog = None
    if config.kv_events_endpoint:
        topic = config.kv_events_topic or default_topic(config.worker_id, config.model)
        publisher = KvEventPublisher(config.kv_events_endpoint, topic, config.kv_events_replay_endpoint)
        catalog = BlockCatalog(max_blocks=4 * profile.num_gpu_blocks + 10_000)
        logger.info("publishing KV events on %s topic %s", publisher.endpoint, topic)

    async def publish(events: list[EngineKvEvent]) -> None:
        if publisher is None or catalog is None:
            return
        # the catalog keeps removed keys too (bounded LRU): a key may be stored again in the same batch
        await publisher.publish(to_vllm_events(events, catalog, profile.block_size))

    driver = EngineDriver(
        Engine(profile, record_kv_events=publisher is not None),
        config.time_scale,
        stream_interval_s=config.stream_interval_s,
        kv_sink=publish if publisher is not None else None,
    )
    max_model_len = config.effective_max_model_len(profile)
    if max_model_len < config.max_model_len:
        logger.info("max_model_len %d capped to the KV pool: %d tokens", config.max_model_len, max_model_len)
    worker = Worker(
        config,
        profile,
        driver,
        RequestMetrics(),
        catalog,
        publisher,
        Counter(),
        random.Random(),
        max_model_len,
        engine_tokenizer.load(config.tokenizer),
    )
    app[WORKER] = worker
    task = spawn(driver.run(), name=f"emulator-driver-{config.worker_id}")
    replay = (
        spawn(publisher.serve_replay(), name=f"emulator-replay-{config.worker_id}") if publisher else None
    )
    try:
        yield
    finally:
        await cancel_and_wait(task)
        if replay is not None:
            await cancel_and_wait(replay)
        if publisher is not None:
            publisher.close()


def create_app(config: EmulatorConfig) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_not_found])
    app[WORKER_CONFIG] = config
    app.cleanup_ctx.append(engine_context)
    app.router.add_post("/v1/chat/completions", completion_handler("chat"))
    app.router.add_post("/v1/completions", completion_handler("completion"))
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize_endpoint)
    app.router.add_post("/v1/chat/completions/render", render_endpoint)
    app.router.add_post("/v1/completions/render", render_endpoint)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/kvgate/inflight", inflight)
    app.router.add_get("/kvgate/held_log", held_log)
    app.router.add_post("/kvgate/kv_faults", kv_faults)
    return app


async def start_emulator(config: EmulatorConfig) -> tuple[web.AppRunner, int]:
    """Serve `config` on config.host:config.port (0 = a free port); returns the runner and the bound port.
    Stop it with `await runner.cleanup()`."""
    # handler cancellation: a client that goes away aborts its request; a short shutdown grace for streams
    runner = web.AppRunner(
        create_app(config), handler_cancellation=True, access_log=None, shutdown_timeout=3.0
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    return runner, int(port)


def worker_of(app: web.Application) -> Worker:
    """The running worker state of an app (tests)."""
    return app[WORKER]
