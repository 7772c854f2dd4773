"""A deliberately trivial OpenAI-compatible upstream for overhead measurements.

It answers at once (no engine model), so that in `kvgate bench overhead` the proxies, not the
worker, are what saturates. Non-streaming requests get one small completion; streaming requests
get `chunks` SSE events written back to back, then a usage event and `[DONE]`.

It also serves vLLM's /tokenize and /render (cheap stand-in token ids), which vllm-router calls.

Run: `python -m bench.echo_upstream --port P [--model M]` (prints nothing; GET /health answers).
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

MODEL_KEY = web.AppKey("model", str)


def _completion(model: str, prompt_chars: int) -> dict[str, object]:
    return {
        "id": "cmpl-echo",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt_chars // 4,
            "completion_tokens": 1,
            "total_tokens": prompt_chars // 4 + 1,
        },
    }


async def chat(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = json.loads(raw)
    model = request.app[MODEL_KEY]
    if not body.get("stream"):
        return web.json_response(_completion(model, len(raw)))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for i in range(int(body.get("max_tokens") or 8)):
        delta = {
            "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
            "model": model,
        }
        await resp.write(b"data: " + json.dumps(delta).encode() + b"\n\n")
    usage = {"prompt_tokens": len(raw) // 4, "completion_tokens": 8, "total_tokens": len(raw) // 4 + 8}
    await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _token_ids(body: dict[str, object]) -> list[int]:
    """Cheap stand-in token ids (one per 4 bytes of the prompt text), the same for the same text."""
    messages = body.get("messages")
    if isinstance(messages, list):
        text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    else:
        text = str(body.get("prompt", ""))
    raw = text.encode()
    return [int.from_bytes(raw[i : i + 4], "little") % 128_000 for i in range(0, len(raw), 4)]


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize, so that vllm-router's cache_aware finds what it calls on a vLLM worker."""
    tokens = _token_ids(await request.json())
    return web.json_response({"count": len(tokens), "max_model_len": 131072, "tokens": tokens})


async def render(request: web.Request) -> web.Response:
    """vLLM's /v1/chat/completions/render (vllm-router calls it on every worker per request)."""
    body = await request.json()
    rendered = {"request_id": "render-0", "model": request.app[MODEL_KEY], "token_ids": _token_ids(body),
                "stream": False}  # fmt: skip
    return web.json_response(rendered if request.path.startswith("/v1/chat/") else [rendered])


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": request.app[MODEL_KEY], "object": "model"}]})


async def metrics(_: web.Request) -> web.Response:
    # enough of vLLM's names for an agent or a static-worker health check to be satisfied
    text = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
    return web.Response(text=text, content_type="text/plain")


def create_app(model: str) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[MODEL_KEY] = model
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions/render", render)
    app.router.add_post("/v1/completions/render", render)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.echo_upstream")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="bench-model")
    args = parser.parse_args(argv)
    web.run_app(create_app(args.model), host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
