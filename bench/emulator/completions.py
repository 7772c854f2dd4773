"""POST /v1/chat/completions and /v1/completions of the emulated vLLM worker.

A request's prompt becomes engine blocks (Worker.engine_blocks); the handler submits it to the engine
driver and follows it: non-streamed, it answers once the engine finishes it; streamed, it sends the SSE
headers at once and then chunks from the first token on, one per token, flushed as the driver reports
progress. A client that goes away (write error, or handler cancellation while waiting) aborts the request
in the engine; the `finally` of `run_completion` is the one place a request leaves the worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from bench.emulator.driver import EngineBroken, RequestState
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
from bench.emulator.worker import ENGINE_FAILED, WORKER, Worker, error_response, read_json

logger = logging.getLogger(__name__)


def completion_handler(kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        worker = request.app[WORKER]
        config = worker.config
        try:
            body = await read_json(request)
            job = parse_completion_request(
                kind, body, config.models, config.default_max_tokens, worker.max_model_len, worker.tokenizer
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
        state = worker.driver.submit(
            external_id,
            worker.engine_blocks(job.prompt_tokens, worker.lora_of(job.model), job.cache_salt),
            job.max_tokens,
        )
    except EngineBroken as e:
        return error_response(ApiError(500, str(e)))
    worker.metrics.request_started(len(job.prompt_tokens))
    worker.held[external_id] += 1
    worker.log_held(1, external_id)
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
        worker.log_held(-1, external_id)
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
