"""The emulated vLLM worker's other endpoints: /v1/models, /health, /version, /tokenize, the two
/render endpoints, /metrics, /reset_prefix_cache, /kvgate/inflight, and FastAPI-style JSON bodies
for unknown paths.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from bench.emulator.metrics import render
from bench.emulator.openai_api import ApiError
from bench.emulator.tokenizer import TemplateError
from bench.emulator.worker import WORKER, error_response, read_json

logger = logging.getLogger(__name__)


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
                tokens = worker.tokenizer.chat(body)
            except TemplateError as e:
                raise ApiError(400, str(e), "messages") from None
        elif isinstance(body.get("prompt"), str):
            tokens = worker.tokenizer.text(body["prompt"], bool(body.get("add_special_tokens", True)))
        else:
            raise ApiError(400, "give a prompt string or a messages list", "prompt")
    except ApiError as e:
        return error_response(e)
    return web.json_response(
        {"count": len(tokens), "max_model_len": worker.max_model_len, "tokens": tokens, "token_strs": None}
    )


async def render_endpoint(request: web.Request) -> web.Response:
    """vLLM's /v1/chat/completions/render and /v1/completions/render: the prompt's tokens without running it.

    As current vLLM renders a request for /inference/v1/generate: chat answers one object
    `{"request_id", "model", "token_ids", "stream"}`, completions a list of them (one per prompt).
    vllm-router's cache_aware calls the chat one on every worker per request (then /tokenize on 404),
    and llm-d's token producer tokenizes through it."""
    worker = request.app[WORKER]
    chat = request.path.startswith("/v1/chat/")
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        if (model := body.get("model")) is not None and model not in worker.config.models:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        if chat:
            try:
                token_lists = [worker.tokenizer.chat(body)]
            except TemplateError as e:
                raise ApiError(400, str(e), "messages") from None
        elif isinstance(body.get("prompt"), str):
            token_lists = [worker.tokenizer.text(body["prompt"], True)]
        elif isinstance(body.get("prompt"), list) and all(isinstance(p, str) for p in body["prompt"]):
            token_lists = [worker.tokenizer.text(p, True) for p in body["prompt"]]
        else:
            raise ApiError(400, "give a prompt string or a list of strings", "prompt")
    except ApiError as e:
        return error_response(e)
    name = body.get("model") or worker.config.model
    rendered = [
        {"request_id": f"render-{i}", "model": name, "token_ids": tokens, "stream": False}
        for i, tokens in enumerate(token_lists)
    ]
    return web.json_response(rendered[0] if chat else rendered)


async def metrics_endpoint(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    text = render(worker.config.model, worker.metrics, worker.snapshot())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    request.app[WORKER].driver.clear_cache()
    return web.Response(status=200)


async def kv_faults(request: web.Request) -> web.Response:
    """Faults for the next KV-event batches: {"drop": n, "duplicate": n, "reorder": n} (adds to them)."""
    worker = request.app[WORKER]
    try:
        body = await read_json(request)
        if worker.publisher is None:
            raise ApiError(400, "this worker publishes no KV events")
        if not isinstance(body, dict) or any(
            k not in worker.publisher.faults or type(v) is not int or v < 0 for k, v in body.items()
        ):
            raise ApiError(400, "body: {drop, duplicate, reorder}: counts >= 0")
    except ApiError as e:
        return error_response(e)
    for name, count in body.items():
        worker.publisher.faults[name] += count
    return web.json_response(worker.publisher.faults)


async def inflight(request: web.Request) -> web.Response:
    return web.json_response({"request_ids": sorted(request.app[WORKER].held)})


async def held_log(request: web.Request) -> web.Response:
    """Entries of the worker's held log from `?since=N` (a count of entries ever logged): {"boot":
    this process's start, "next": the cursor for the next call, "entries": [[t, +1|-1, id], ...]}."""
    worker = request.app[WORKER]
    since = int(request.query.get("since", "0") or 0)
    first = worker.held_log_total - len(worker.held_log)
    entries = list(worker.held_log)[max(0, since - first) :]
    return web.json_response({"boot": BOOT, "next": worker.held_log_total, "entries": entries})


BOOT = time.time()


@web.middleware
async def json_not_found(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """FastAPI's JSON bodies for unknown paths and methods, as vLLM answers them."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        # logged: a router probing a path the emulator lacks is a gap to close (kvgate bench live)
        logger.warning("no route for %s %s (answered 404)", request.method, request.path)
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(ApiError(413, f"request body too large: {e.text}"))
