"""Request intake: which endpoint a request is for, and its body validated against the limits.

Pure functions (no flow, no I/O) so the validation table is unit-tested directly. Every failure is
a `GatewayError` with the status the client gets: 400 malformed JSON / wrong types / missing fields,
413 too large, 404 unknown path, 405 wrong method.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from plugin.config import LimitsSection
from plugin.errors import GatewayError

Endpoint = Literal["chat", "completions", "models", "healthz", "readyz", "metrics"]

# path -> (endpoint, allowed method)
ROUTES: dict[str, tuple[Endpoint, str]] = {
    "/v1/chat/completions": ("chat", "POST"),
    "/v1/completions": ("completions", "POST"),
    "/v1/models": ("models", "GET"),
    "/healthz": ("healthz", "GET"),
    "/readyz": ("readyz", "GET"),
    "/metrics": ("metrics", "GET"),
}

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """One completion request, validated."""

    endpoint: Literal["chat", "completions"]
    model: str
    stream: bool
    max_tokens: int  # requested, or limits.default_max_tokens when absent
    include_usage: bool  # the client asked for the stream's usage chunk
    body: dict[str, Any]


def route_for(method: str, path: str) -> Endpoint:
    """The endpoint for a method and path (query string ignored); GatewayError 404/405 otherwise."""
    bare = path.split("?", 1)[0].rstrip("/") or "/"
    found = ROUTES.get(bare)
    if found is None:
        raise GatewayError(404, "not_found", f"kvgate serves no {bare}")
    endpoint, allowed = found
    if method != allowed and not (allowed == "GET" and method == "HEAD"):
        raise GatewayError(405, "method_not_allowed", f"{bare} takes {allowed}, not {method}")
    return endpoint


def parse_completion(
    endpoint: Literal["chat", "completions"], raw: bytes, limits: LimitsSection
) -> ParsedRequest:
    """Decode and validate a completion request body."""
    if len(raw) > limits.max_body_bytes:
        raise GatewayError(
            413, "request_too_large", f"body is {len(raw)} bytes; limit {limits.max_body_bytes}"
        )
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GatewayError(400, "invalid_json", f"body is not valid JSON: {e}") from None
    except RecursionError:
        body = None
        deep = True
    else:  # anything past MAX_DEPTH would recurse too deeply later (hashing, re-encoding)
        deep = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and too_deep(body)
    if deep:
        raise GatewayError(
            400, "invalid_json", f"body nests arrays and objects deeper than {MAX_DEPTH} levels"
        )
    if not isinstance(body, dict):
        raise GatewayError(400, "invalid_body", "body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise GatewayError(400, "missing_model", "'model' must be a non-empty string", param="model")
    if "{" in model or "}" in model:
        raise GatewayError(400, "invalid_model", "'model' may not contain braces", param="model")
    if endpoint == "chat":
        _check_messages(body.get("messages"), limits)
    else:
        _check_prompt(body.get("prompt"), limits)
    stream = _optional(body, "stream", bool, False)
    max_tokens = _max_tokens(body, limits)
    n = _optional(body, "n", int, 1)
    if not 1 <= n <= limits.max_n:
        raise GatewayError(400, "invalid_n", f"'n' must be between 1 and {limits.max_n}", param="n")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise GatewayError(400, "invalid_type", f"'{name}' must be a number", param=name)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise GatewayError(400, "invalid_type", "'stream_options' must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage") is True)
    return ParsedRequest(endpoint, model, stream, max_tokens, include_usage, body)


MAX_DEPTH = 64  # of JSON arrays and objects: far above any OpenAI request, far below the recursion limit


def too_deep(value: object, limit: int = MAX_DEPTH) -> bool:
    """Whether a decoded JSON value nests arrays/objects deeper than `limit` (iterative: no recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _check_messages(messages: object, limits: LimitsSection) -> None:
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "missing_messages", "'messages' must be a non-empty array", param="messages")
    if len(messages) > limits.max_messages:
        raise GatewayError(
            400,
            "too_many_messages",
            f"{len(messages)} messages; limit {limits.max_messages}",
            param="messages",
        )
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise GatewayError(400, "invalid_message", f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise GatewayError(400, "invalid_role", f"messages[{i}].role must be one of {sorted(ROLES)}")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise GatewayError(
                        400, "invalid_content", f"messages[{i}].content[{j}] must be an object with a 'type'"
                    )
                text = part.get("text")
                chars += len(text) if isinstance(text, str) else 0
        elif content is not None:
            raise GatewayError(400, "invalid_content", f"messages[{i}].content must be a string or an array")
    if chars > limits.max_prompt_chars:
        raise GatewayError(
            413, "prompt_too_large", f"prompt has {chars} characters; limit {limits.max_prompt_chars}"
        )


def _check_prompt(prompt: object, limits: LimitsSection) -> None:
    if isinstance(prompt, str):
        size = len(prompt)
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            size = sum(len(p) for p in prompt)
        elif all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            size = len(prompt) * 4
        elif all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            size = sum(len(p) for p in prompt) * 4
        else:
            raise GatewayError(
                400, "invalid_prompt", "'prompt' must be a string, strings, or token ids", param="prompt"
            )
    else:
        raise GatewayError(
            400, "missing_prompt", "'prompt' must be a non-empty string or array", param="prompt"
        )
    if size > limits.max_prompt_chars:
        raise GatewayError(
            413, "prompt_too_large", f"prompt has {size} characters; limit {limits.max_prompt_chars}"
        )


def _max_tokens(body: dict[str, Any], limits: LimitsSection) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise GatewayError(400, "invalid_type", f"'{name}' must be an integer", param=name)
        if not 1 <= value <= limits.max_tokens:
            raise GatewayError(
                400, "invalid_max_tokens", f"'{name}' must be between 1 and {limits.max_tokens}"
            )
        return value
    return limits.default_max_tokens


def _optional(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GatewayError(
            400, "invalid_type", f"'{name}' must be {'a boolean' if kind is bool else 'an integer'}"
        )
    return value
