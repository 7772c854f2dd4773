"""Request intake: a completion request's body validated against the limits.

Pure functions (no flow, no I/O) so the validation table is unit-tested directly. Every failure is
a `GatewayError` with the status the client gets: 400 malformed JSON / wrong types / missing fields,
413 too large. Which endpoint a path is, and its own fields, are the endpoint table's (endpoints.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from plugin import jsonbody
from plugin.config import LimitsSection
from plugin.endpoints import Endpoint
from plugin.errors import GatewayError


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """One completion request, validated."""

    endpoint: Endpoint  # its entry in the endpoint table (plugin/endpoints.py)
    model: str
    stream: bool
    max_tokens: int  # requested, or limits.default_max_tokens when absent
    include_usage: bool  # the client asked for the stream's usage chunk
    body: dict[str, Any]


def parse_completion(endpoint: Endpoint, raw: bytes, limits: LimitsSection) -> ParsedRequest:
    """Decode and validate a completion request body: the common fields here, the endpoint's own
    (`messages`, `prompt`, ...) by its entry in the endpoint table."""
    if len(raw) > limits.max_body_bytes:
        raise GatewayError(
            413, "request_too_large", f"body is {len(raw)} bytes; limit {limits.max_body_bytes}"
        )
    try:
        body = jsonbody.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GatewayError(400, "invalid_json", f"body is not valid JSON: {e}") from None
    except RecursionError:
        body = None
        deep = True
    else:  # anything past MAX_DEPTH would recurse too deeply later (hashing, re-encoding)
        small = too_deep_small(body)  # None for a large body: its brackets counted first (cheaper)
        deep = (
            small if small is not None else raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and too_deep(body)
        )
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
    endpoint.check_body(body, limits)
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


WALK_BUDGET = 64  # values `too_deep_small` looks at before it leaves the answer to the bracket count


def too_deep_small(value: object, limit: int = MAX_DEPTH, budget: int = WALK_BUDGET) -> bool | None:
    """`too_deep(value, limit)` for a value of at most `budget` nested values (a chat body of a few
    messages: a handful), else None. Cheaper than counting the brackets of the raw body, which reads
    every byte of a long prompt (~15 us for the bench's 16 kB body, bench.hook_cost)."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[dict[str, object] | list[object], int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        budget -= len(children)
        if budget < 0:
            return None
        for child in children:
            if isinstance(child, _CONTAINERS):
                stack.append((child, depth + 1))
    return False


_CONTAINERS = (dict, list)


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
