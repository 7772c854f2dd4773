"""Request intake: endpoints, and the validation table (status and code for each malformed body)."""

from __future__ import annotations

import json

import pytest

from plugin.config import LimitsSection
from plugin.endpoints import ENDPOINTS, route_for
from plugin.errors import GatewayError
from plugin.parse import parse_completion

LIMITS = LimitsSection(
    max_body_bytes=10_000,
    max_messages=4,
    max_prompt_chars=1_000,
    max_tokens=1_000,
    default_max_tokens=50,
    max_n=2,
)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("method", "path", "endpoint"),
    [
        ("POST", "/v1/chat/completions", "chat"),
        ("POST", "/v1/completions", "completions"),
        ("GET", "/v1/models", "models"),
        ("GET", "/v1/models/", "models"),
        ("GET", "/readyz", "readyz"),
    ],
)
def test_routes(method: str, path: str, endpoint: str) -> None:
    found = route_for(method, path)
    assert (found if isinstance(found, str) else found.name) == endpoint


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/embeddings", 404),
        ("GET", "/", 404),
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
    ],
)
def test_unknown_routes(method: str, path: str, status: int) -> None:
    with pytest.raises(GatewayError) as info:
        route_for(method, path)
    assert info.value.status == status


def test_valid_chat_defaults() -> None:
    parsed = parse_completion(ENDPOINTS["chat"], json.dumps(CHAT).encode(), LIMITS)
    assert (parsed.model, parsed.stream, parsed.max_tokens, parsed.include_usage) == ("m", False, 50, False)


def test_valid_stream_completion_with_usage() -> None:
    body = {
        "model": "m",
        "prompt": ["a", "b"],
        "stream": True,
        "max_tokens": 7,
        "stream_options": {"include_usage": True},
    }
    parsed = parse_completion(ENDPOINTS["completions"], json.dumps(body).encode(), LIMITS)
    assert (parsed.endpoint.name, parsed.stream, parsed.max_tokens, parsed.include_usage) == (
        "completions",
        True,
        7,
        True,
    )


def chat(**changes: object) -> bytes:
    body: dict[str, object] = {**CHAT, **changes}
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    ("endpoint", "raw", "status", "code"),
    [
        pytest.param("chat", b"{not json", 400, "invalid_json", id="malformed JSON"),
        pytest.param("chat", b"\xff\xfe", 400, "invalid_json", id="not UTF-8"),
        pytest.param("chat", b"[1, 2]", 400, "invalid_body", id="array body"),
        pytest.param("chat", b"x" * 10_001, 413, "request_too_large", id="body over the byte limit"),
        pytest.param("chat", chat(model=...), 400, "missing_model", id="missing model"),
        pytest.param("chat", chat(model=3), 400, "missing_model", id="model not a string"),
        pytest.param("chat", chat(model="a{b}"), 400, "invalid_model", id="model with braces"),
        pytest.param("chat", chat(messages=...), 400, "missing_messages", id="missing messages"),
        pytest.param("chat", chat(messages=[]), 400, "missing_messages", id="empty messages"),
        pytest.param("chat", chat(messages="hi"), 400, "missing_messages", id="messages a string"),
        pytest.param(
            "chat",
            chat(messages=[{"role": "user", "content": "x"}] * 5),
            400,
            "too_many_messages",
            id="too many messages",
        ),
        pytest.param("chat", chat(messages=["hi"]), 400, "invalid_message", id="message not an object"),
        pytest.param(
            "chat", chat(messages=[{"role": "boss", "content": "x"}]), 400, "invalid_role", id="unknown role"
        ),
        pytest.param(
            "chat",
            chat(messages=[{"role": "user", "content": 5}]),
            400,
            "invalid_content",
            id="content a number",
        ),
        pytest.param(
            "chat",
            chat(messages=[{"role": "user", "content": [{"text": "x"}]}]),
            400,
            "invalid_content",
            id="content part without type",
        ),
        pytest.param(
            "chat",
            chat(messages=[{"role": "user", "content": "x" * 1001}]),
            413,
            "prompt_too_large",
            id="prompt over the character limit",
        ),
        pytest.param("chat", chat(max_tokens=0), 400, "invalid_max_tokens", id="max_tokens 0"),
        pytest.param(
            "chat", chat(max_tokens=1001), 400, "invalid_max_tokens", id="max_tokens over the limit"
        ),
        pytest.param("chat", chat(max_tokens="5"), 400, "invalid_type", id="max_tokens a string"),
        pytest.param("chat", chat(max_completion_tokens=True), 400, "invalid_type", id="max_tokens a bool"),
        pytest.param("chat", chat(stream="yes"), 400, "invalid_type", id="stream a string"),
        pytest.param("chat", chat(n=3), 400, "invalid_n", id="n over the limit"),
        pytest.param("chat", chat(temperature="hot"), 400, "invalid_type", id="temperature a string"),
        pytest.param(
            "chat", chat(stream_options=True), 400, "invalid_type", id="stream_options not an object"
        ),
        pytest.param("completions", b'{"model": "m"}', 400, "missing_prompt", id="missing prompt"),
        pytest.param(
            "completions",
            b'{"model": "m", "prompt": [1, "a"]}',
            400,
            "invalid_prompt",
            id="mixed prompt list",
        ),
        pytest.param(
            "completions", b'{"model": "m", "prompt": {"a": 1}}', 400, "missing_prompt", id="prompt an object"
        ),
    ],
)
def test_invalid_bodies(endpoint: str, raw: bytes, status: int, code: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_completion(ENDPOINTS[endpoint], raw, LIMITS)
    assert (info.value.status, info.value.code) == (status, code)
