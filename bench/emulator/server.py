"""The emulated vLLM worker's HTTP server (aiohttp): what a router, an agent or a client talks to.

Endpoints, as vLLM serves them: POST /v1/chat/completions and /v1/completions (SSE when `stream`),
GET /v1/models, GET /health, GET /version, POST /tokenize, GET /metrics, POST /reset_prefix_cache;
plus GET /kvgate/inflight (ids of the requests held now, from X-Request-Id, for agent
reconciliation). A request's prompt becomes engine blocks keyed by the chained block keys
(bench/emulator/tokenizer.py); the engine (bench/sim/engine.py, via driver.py) decides when its first
token comes, how much of it was cached, and how fast it decodes.
A client that disconnects aborts its request in the engine (handler cancellation is on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from bench.emulator.driver import EngineBroken, EngineDriver, RequestState
from bench.emulator.kv_events import (
    BlockCatalog,
    EngineKvEvent,
    KvEventPublisher,
    default_topic,
    to_vllm_events,
)
from bench.emulator.metrics import EngineSnapshot, RequestMetrics, render
from bench.emulator.openai_api import (
    DONE,
    ApiError,
    ChunkWriter,
    CompletionJob,
    Kind,
    full_response,
    new_response_id,
    parse_completion_request,
    sse,
)
from bench.emulator.tokenizer import TemplateError, full_block_keys, render_chat, tokenize
from bench.sim.engine import Engine
from bench.sim.profiles import EngineProfile, load_profile, scaled
from plugin.tasks import cancel_and_wait, spawn

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024 * 1024  # a 128k-token prompt is ~0.5 MB of text; leave room for JSON


@dataclass(frozen=True)
class EmulatorConfig:
    model: str = "emulated-model"
    extra_model_names: tuple[
        str, ...
    ] = ()  # more names served for the same engine (vLLM --served-model-name)
    profile: str = "h100-llama3.1-8b"
    num_gpu_blocks: int | None = None  # override the profile's KV pool (smaller pools show cache pressure)
    time_scale: float = 1.0  # wall seconds per virtual second: 0.1 runs 10x faster than the modelled GPU
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = "emulator"
    kv_events_endpoint: str | None = None  # e.g. tcp://127.0.0.1:5557 (bound); None = no KV events
    kv_events_topic: str | None = None  # default kv@<worker_id>@<model>
    default_max_tokens: int = 64  # output length when a request gives no max_tokens
    max_model_len: int = 131_072
    stream_interval_s: float = 0.02  # decoding streams flush new tokens at most this often (wall)

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be > 0, got {self.num_gpu_blocks}")
        if self.default_max_tokens <= 0 or self.max_model_len <= 0:
            raise ValueError("default_max_tokens and max_model_len must be > 0")
        if self.stream_interval_s <= 0:
            raise ValueError(f"stream_interval_s must be > 0, got {self.stream_interval_s}")

    def effective_max_model_len(self, profile: EngineProfile) -> int:
        """vLLM refuses to start when one max-length request cannot fit its KV pool; the emulator, whose
        pool is often shrunk on purpose (`num_gpu_blocks`), lowers max_model_len to the pool instead."""
        return min(self.max_model_len, profile.capacity_tokens)

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model, *self.extra_model_names)

    def engine_profile(self) -> EngineProfile:
        profile = load_profile(self.profile)
        if self.num_gpu_blocks is not None:
            profile = scaled(profile, num_gpu_blocks=self.num_gpu_blocks)
        return profile


@dataclass
class Worker:
    """Everything one server holds: the engine driver and what the HTTP layer counts."""

    config: EmulatorConfig
    profile: EngineProfile
    driver: EngineDriver
    metrics: RequestMetrics
    catalog: BlockCatalog | None  # only with KV events
    publisher: KvEventPublisher | None
    held: Counter[str]  # external request ids of the completion requests in flight
    rng: random.Random
    max_model_len: int  # the config's, capped to the KV pool

    def engine_blocks(self, tokens: list[int]) -> list[tuple[int, int]]:
        """(key, tokens) per engine block: full blocks by chained key; the trailing partial block gets a
        key no other request uses, so it is never a cache hit (vLLM caches full blocks only)."""
        size = self.profile.block_size
        keys = full_block_keys(tokens, size)
        if self.catalog is not None:
            self.catalog.remember(keys, tokens, size)
        blocks = [(key, size) for key in keys]
        if rest := len(tokens) - len(keys) * size:
            blocks.append((self.rng.getrandbits(64), rest))
        return blocks

    def snapshot(self) -> EngineSnapshot:
        engine = self.driver.engine
        return EngineSnapshot(
            running=engine.running,
            waiting=engine.waiting,
            kv_usage=float(engine.kv_usage),
            prefix_cache_queries=int(engine.prefix_cache_queries),
            prefix_cache_hits=int(engine.prefix_cache_hits),
            num_preemptions=int(engine.num_preemptions),
            block_size=self.profile.block_size,
            num_gpu_blocks=self.profile.num_gpu_blocks,
        )


WORKER_CONFIG = web.AppKey("worker_config", EmulatorConfig)
WORKER = web.AppKey("worker", Worker)


ENGINE_FAILED = ApiError(500, "the emulated engine failed; see the worker's log")


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


async def read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"Invalid JSON body: {e}") from None


# --- completions ---


def completion_handler(kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        worker = request.app[WORKER]
        config = worker.config
        try:
            body = await read_json(request)
            job = parse_completion_request(
                kind, body, config.models, config.default_max_tokens, worker.max_model_len
            )
        except ApiError as e:
            return error_response(e)
        given_id = request.headers.get("X-Request-Id")
        response_id = new_response_id(kind, given_id)
        return await run_completion(request, worker, job, given_id or response_id, response_id)

    return handle


async def run_completion(
    request: web.Request, worker: Worker, job: CompletionJob, external_id: str, response_id: str
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        state = worker.driver.submit(external_id, worker.engine_blocks(job.prompt_tokens), job.max_tokens)
    except EngineBroken as e:
        return error_response(ApiError(500, str(e)))
    worker.metrics.request_started(len(job.prompt_tokens))
    worker.held[external_id] += 1
    try:
        if job.stream:
            return await stream_completion(request, worker, job, state, external_id, response_id, started)
        await wait_until(state, lambda: state.started or state.failed)
        if not state.failed:
            worker.metrics.ttft.observe(loop.time() - started)
        await wait_until(state, lambda: state.finished)
        if state.failed:
            return error_response(ENGINE_FAILED)
        body = full_response(job, response_id, job.max_tokens, state.cached_tokens)
        worker.metrics.e2e.observe(loop.time() - started)
        return web.json_response(body, headers={"X-Request-Id": external_id})
    finally:
        generated = worker.driver.refresh(state)
        worker.driver.abort(state)  # no-op when it finished
        worker.metrics.request_ended(generated)
        worker.held[external_id] -= 1
        if worker.held[external_id] <= 0:
            del worker.held[external_id]


async def wait_until(state: RequestState, condition: Callable[[], bool]) -> None:
    while not condition():
        await state.wake.wait()
        state.wake.clear()


async def stream_completion(
    request: web.Request,
    worker: Worker,
    job: CompletionJob,
    state: RequestState,
    external_id: str,
    response_id: str,
    started: float,
) -> web.StreamResponse:
    """SSE as vLLM sends it: headers at once, then chunks from the first token on, one per token."""
    loop = asyncio.get_running_loop()
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Request-Id": external_id,
        }
    )
    await response.prepare(request)
    writer = ChunkWriter(job, response_id)
    try:
        await wait_until(state, lambda: state.started or state.failed)
        if not state.failed:
            worker.metrics.ttft.observe(loop.time() - started)
        out = writer.role_chunk()
        sent = 0
        while True:
            if state.failed:  # vLLM reports errors mid-stream as an error event, then [DONE]
                await response.write(sse(ENGINE_FAILED.body()) + DONE)
                return response
            if state.finished:
                last = job.max_tokens - 1
                out += writer.token_chunks(sent, last) + writer.final_chunk(last)
                if job.include_usage:
                    out += writer.usage_chunk(len(job.prompt_tokens), job.max_tokens, state.cached_tokens)
                await response.write(out + DONE)
                break
            # the last token goes out with finish_reason, once the engine says the request finished
            generated = min(worker.driver.refresh(state), job.max_tokens - 1)
            if generated > sent:
                out += writer.token_chunks(sent, generated)
                sent = generated
            if out:
                await response.write(out)
                out = b""
            await state.wake.wait()
            state.wake.clear()
        worker.metrics.e2e.observe(loop.time() - started)
        await response.write_eof()
    except ConnectionResetError:
        logger.debug("client of %s went away mid-stream", external_id)
    return response


# --- the other endpoints ---


async def list_models(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    config = worker.config
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": config.model,
         "parent": None, "max_model_len": worker.max_model_len}
        for name in config.models
    ]  # fmt: skip
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": "kvgate-emulator"})


async def tokenize_endpoint(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}."""
    worker = request.app[WORKER]
    config = worker.config
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        if (model := body.get("model")) is not None and model not in config.models:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        if "messages" in body:
            try:
                text = render_chat(body["messages"])
            except TemplateError as e:
                raise ApiError(400, str(e), "messages") from None
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise ApiError(400, "give a prompt string or a messages list", "prompt")
    except ApiError as e:
        return error_response(e)
    tokens = tokenize(text)
    return web.json_response(
        {"count": len(tokens), "max_model_len": worker.max_model_len, "tokens": tokens, "token_strs": None}
    )


async def metrics_endpoint(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    text = render(worker.config.model, worker.metrics, worker.snapshot())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    request.app[WORKER].driver.clear_cache()
    return web.Response(status=200)


async def inflight(request: web.Request) -> web.Response:
    return web.json_response({"request_ids": sorted(request.app[WORKER].held)})


@web.middleware
async def json_not_found(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """FastAPI's JSON bodies for unknown paths and methods, as vLLM answers them."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(ApiError(413, f"request body too large: {e.text}"))


# --- assembly ---


async def engine_context(app: web.Application) -> AsyncIterator[None]:
    """Engine, KV-event publisher and the driver task for the server's lifetime."""
    config = app[WORKER_CONFIG]
    profile = config.engine_profile()
    publisher = catalog = None
    if config.kv_events_endpoint:
        topic = config.kv_events_topic or default_topic(config.worker_id, config.model)
        publisher = KvEventPublisher(config.kv_events_endpoint, topic)
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
    )
    app[WORKER] = worker
    task = spawn(driver.run(), name=f"emulator-driver-{config.worker_id}")
    try:
        yield
    finally:
        await cancel_and_wait(task)
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
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/kvgate/inflight", inflight)
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
