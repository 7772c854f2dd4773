"""OpenAI request validation and response bodies of the emulated worker, shaped like vLLM's.

Pure functions: `parse_completion_request()` turns a decoded JSON body into a `CompletionJob` or
raises `ApiError` (status + vLLM-style error JSON); the `*_chunk` / `*_response` helpers build the
SSE chunks and JSON bodies. Generated text is deterministic filler: token i is `FILLER[i % n]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from bench.emulator.engine_tokenizer import EngineTokenizer, FakeTokenizer
from bench.emulator.tokenizer import TemplateError

Kind = Literal["chat", "completion"]
FILLER = (" the", " KV", " cache", " keeps", " every", " prefix", " warm", " and", " fast", ".")
DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """A client error with vLLM's error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        return {400: "BadRequestError", 404: "NotFoundError"}.get(self.status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True)
class CompletionJob:
    kind: Kind
    model: str
    prompt_tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None = None  # vLLM's request field: salts the prefix-cache keys (block 0 on)


def _optional(body: Mapping[str, Any], name: str, types: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    # bool is an int in Python; a JSON true is never a valid count or number
    wrong_bool = isinstance(value, bool) and bool not in types
    if value is not None and (not isinstance(value, types) or wrong_bool):
        raise ApiError(400, f"{name}: must be {what}, not {json.dumps(value)[:40]}", name)
    return value


def parse_completion_request(
    kind: Kind,
    body: Any,
    served_models: tuple[str, ...],
    default_max_tokens: int,
    max_model_len: int,
    tokenizer: EngineTokenizer | None = None,
) -> CompletionJob:
    """Validate a /v1/chat/completions or /v1/completions body the way vLLM rejects bad input."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = _optional(body, "model", (str,), "a string") or served_models[0]
    if model not in served_models:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    tokenizer = tokenizer or FakeTokenizer()
    if kind == "chat":
        try:
            prompt_tokens = tokenizer.chat(body)
        except TemplateError as e:
            raise ApiError(400, str(e), "messages") from None
    else:
        prompt_tokens = _completion_prompt(body.get("prompt"), tokenizer)
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    max_tokens = default_max_tokens
    for name in names:
        if (value := _optional(body, name, (int,), "an integer")) is not None:
            if value < 1:
                raise ApiError(400, f"{name}: must be at least 1, got {value}", name)
            max_tokens = value
            break
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _optional(body, name, (int, float), "a number")
    if (n := _optional(body, "n", (int,), "an integer")) not in (None, 1):
        raise ApiError(400, f"n: only n=1 is supported by the emulator, got {n}", "n")
    stream = bool(_optional(body, "stream", (bool,), "a boolean"))
    options = _optional(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    include_usage = bool(options and _optional(options, "include_usage", (bool,), "a boolean"))
    cache_salt = _optional(body, "cache_salt", (str,), "a string")
    if len(prompt_tokens) + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt_tokens) + max_tokens} tokens ({len(prompt_tokens)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
        )
    return CompletionJob(kind, model, prompt_tokens, max_tokens, stream, include_usage, cache_salt or None)


def _completion_prompt(prompt: Any, tokenizer: EngineTokenizer) -> list[int]:
    """A prompt string, a one-element list of strings, or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        return tokenizer.text(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        vocab = tokenizer.vocab_size
        if bad := next((t for t in prompt if not 0 <= t < vocab), None):
            raise ApiError(400, f"prompt: token id {bad} is out of vocabulary (size {vocab})", "prompt")
        return list(prompt)
    raise ApiError(
        400, "prompt: must be a non-empty string or a list of token ids (one prompt only)", "prompt"
    )


def token_text(index: int) -> str:
    return FILLER[index % len(FILLER)]


def generated_text(count: int) -> str:
    return "".join(token_text(i) for i in range(count))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def new_response_id(kind: Kind, request_id: str | None = None) -> str:
    """vLLM's body id: "chatcmpl-<request id>" / "cmpl-<request id>", a random one without a request id."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id or uuid.uuid4().hex}"


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class ChunkWriter:
    """SSE chunks of one streamed response; token chunks are pre-split templates (cheap per token)."""

    def __init__(self, job: CompletionJob, response_id: str, created: int | None = None) -> None:
        self.job = job
        self.head = {
            "id": response_id,
            "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
            "created": int(time.time()) if created is None else created,
            "model": job.model,
        }
        marker = "\x00"
        template = sse(self._choice_chunk(marker, None)).decode()
        self._before, self._after = (part.encode() for part in template.split(json.dumps(marker), 1))

    def _choice_chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.job.kind == "chat":
            choice = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        return {**self.head, "choices": [choice]}

    def role_chunk(self) -> bytes:
        """vLLM's first chat chunk (assistant role, empty content); completions have none."""
        if self.job.kind != "chat":
            return b""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return sse({**self.head, "choices": [choice]})

    def token_chunks(self, start: int, stop: int) -> bytes:
        """Chunks for tokens start..stop-1, one per token, as vLLM streams them."""
        return b"".join(
            self._before + json.dumps(token_text(i)).encode() + self._after for i in range(start, stop)
        )

    def final_chunk(self, last_index: int) -> bytes:
        """The last token's chunk, carrying finish_reason "length"."""
        return sse(self._choice_chunk(token_text(last_index), "length"))

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        return sse(
            {**self.head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
        )


def full_response(
    job: CompletionJob, response_id: str, completion_tokens: int, cached_tokens: int
) -> dict[str, Any]:
    """The non-streamed body."""
    text = generated_text(completion_tokens)
    if job.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    return {
        "id": response_id,
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": job.model,
        "choices": [choice],
        "usage": usage(len(job.prompt_tokens), completion_tokens, cached_tokens),
    }
