"""A thin forwarding proxy for `kvgate bench live`: round-robin, or Dynamo's selection service.

    python -m bench.live_forward --port P --worker URL [--worker URL ...] [--select-url URL]

It streams each POST to one worker unchanged, no retries. Without --select-url it picks workers in
turn (the round-robin baseline); with it, it asks Dynamo's runtime-free selection service
(`python -m dynamo.select_service`, ai-dynamo-runtime) which worker should serve the request's
tokens, and tells the service when the request is done. That service is Dynamo's real KV router
(its Rust selector and indexer, fed by the workers' KV events); this forwarder only stands in for
Dynamo's frontend, so the run is labelled "dynamo_select (selection service + thin forwarder)".
GET paths (/health, /v1/models) go to the first worker.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from bench.emulator.tokenizer import render_chat, tokenize

HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "host"})
WORKERS = web.AppKey("workers", list[str])
SESSION = web.AppKey("session", aiohttp.ClientSession)
PICKER = web.AppKey("picker", object)


class RoundRobin:
    def __init__(self, workers: Sequence[str]) -> None:
        self._next = itertools.cycle(range(len(workers)))

    async def pick(self, session: aiohttp.ClientSession, body: Any) -> tuple[int, str | None]:
        return next(self._next), None

    async def first_bytes(self, session: aiohttp.ClientSession, ticket: str | None) -> None:
        return None

    async def done(self, session: aiohttp.ClientSession, ticket: str | None) -> None:
        return None


def prompt_tokens(body: Any) -> list[int]:
    """The request's tokens as the emulated workers count them (same tokenizer and chat template)."""
    if isinstance(body, dict) and "messages" in body:
        return tokenize(render_chat(body["messages"]))
    prompt = body.get("prompt") if isinstance(body, dict) else None
    return tokenize(prompt if isinstance(prompt, str) else "")


class DynamoSelect:
    """Dynamo's selection service decides and books the load (`/select_and_reserve` with the prompt's
    token ids; Dynamo hashes them itself); the forwarder reports prefill done at the first streamed
    bytes and frees the reservation at the end. Worker i is the service's worker id i."""

    def __init__(self, select_url: str, model: str) -> None:
        self.url = select_url.rstrip("/")
        self.model = model

    async def pick(self, session: aiohttp.ClientSession, body: Any) -> tuple[int, str | None]:
        ticket = uuid.uuid4().hex
        payload = {"model_name": self.model, "token_ids": prompt_tokens(body), "selection_id": ticket}
        async with session.post(f"{self.url}/select_and_reserve", json=payload) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            answer = await resp.json()
        return int(answer["worker_id"]), ticket

    async def first_bytes(self, session: aiohttp.ClientSession, ticket: str | None) -> None:
        if ticket is not None:
            async with session.post(f"{self.url}/reservations/{ticket}/prefill_complete") as resp:
                await resp.read()

    async def done(self, session: aiohttp.ClientSession, ticket: str | None) -> None:
        if ticket is not None:
            async with session.delete(f"{self.url}/reservations/{ticket}") as resp:
                await resp.read()


async def forward(request: web.Request) -> web.StreamResponse:
    workers, session = request.app[WORKERS], request.app[SESSION]
    picker: Any = request.app[PICKER]
    raw = await request.read()
    if request.method != "POST":
        index, ticket = 0, None
    else:
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON", "code": 400}}, status=400)
        try:
            index, ticket = await picker.pick(session, body)
        except (aiohttp.ClientError, KeyError, ValueError) as e:
            return web.json_response(
                {"error": {"message": f"selection failed: {e}", "code": 503}}, status=503
            )
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    try:
        async with session.request(
            request.method, workers[index] + request.path_qs, data=raw, headers=headers
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP_HEADERS:
                    response.headers[k] = v
            response.headers["x-kvgate-worker"] = str(index)
            await response.prepare(request)
            first = True
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                if first:
                    first = False
                    await picker.first_bytes(session, ticket)
            await response.write_eof()
            return response
    except aiohttp.ClientError as e:
        return web.json_response({"error": {"message": f"upstream failed: {e}", "code": 502}}, status=502)
    finally:
        await picker.done(session, ticket)


async def _session_ctx(app: web.Application) -> Any:
    connector = aiohttp.TCPConnector(limit=0)
    app[SESSION] = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
    yield
    await app[SESSION].close()


def create_app(workers: Sequence[str], select_url: str | None, model: str) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[WORKERS] = [w.rstrip("/") for w in workers]
    app[PICKER] = DynamoSelect(select_url, model) if select_url else RoundRobin(workers)
    app.cleanup_ctx.append(_session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live_forward", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker", action="append", required=True, help="worker base URL (repeatable)")
    p.add_argument("--select-url", help="Dynamo selection service base URL; default round-robin")
    p.add_argument("--model", default="live-model", help="model name the workers are registered under")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    web.run_app(
        create_app(args.worker, args.select_url, args.model), host=args.host, port=args.port, print=None
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
