"""Request validation like vLLM's, and the SSE chunks and JSON bodies of the emulated worker."""

from __future__ import annotations

import json

import pytest

from bench.emulator.openai_api import (
    ApiError,
    ChunkWriter,
    CompletionJob,
    full_response,
    generated_text,
    parse_completion_request,
)
from bench.emulator.tokenizer import render_chat, tokenize

MODELS = ("m-1", "m-2")
CHAT = {"model": "m-1", "messages": [{"role": "user", "content": "hello"}]}


def parse(kind: str, body: object, max_model_len: int = 1000):
    return parse_completion_request(kind, body, MODELS, 64, max_model_len)  # type: ignore[arg-type]


def test_a_valid_chat_request_becomes_a_job() -> None:
    job = parse("chat", {**CHAT, "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True}})
    assert job == CompletionJob("chat", "m-1", tokenize(render_chat(CHAT["messages"])), 7, True, True)


@pytest.mark.parametrize(
    ("kind", "body", "field", "value"),
    [
        pytest.param(
            "chat", {"messages": CHAT["messages"]}, "model", "m-1", id="model defaults to the first"
        ),
        pytest.param("chat", {**CHAT, "model": "m-2"}, "model", "m-2", id="second served name"),
        pytest.param("chat", CHAT, "max_tokens", 64, id="default output length"),
        pytest.param(
            "chat",
            {**CHAT, "max_completion_tokens": 5, "max_tokens": 9},
            "max_tokens",
            5,
            id="max_completion_tokens wins",
        ),
        pytest.param(
            "completion", {"prompt": "abcdefgh"}, "prompt_tokens", tokenize("abcdefgh"), id="text prompt"
        ),
        pytest.param(
            "completion", {"prompt": ["abcd"]}, "prompt_tokens", tokenize("abcd"), id="one-string list"
        ),
        pytest.param("completion", {"prompt": [1, 2, 3]}, "prompt_tokens", [1, 2, 3], id="token ids"),
        pytest.param("completion", {"prompt": "x", "stream": False}, "stream", False, id="stream false"),
    ],
)
def test_accepted_fields(kind: str, body: dict, field: str, value: object) -> None:
    assert getattr(parse(kind, body), field) == value


@pytest.mark.parametrize(
    ("kind", "body", "status", "message"),
    [
        pytest.param("chat", [1, 2], 400, "JSON object", id="body is a list"),
        pytest.param("chat", {**CHAT, "model": "nope"}, 404, "does not exist", id="unknown model"),
        pytest.param("chat", {**CHAT, "model": 3}, 400, "model: must be a string", id="model not a string"),
        pytest.param("chat", {"model": "m-1"}, 400, "messages", id="no messages"),
        pytest.param(
            "chat", {**CHAT, "messages": [{"role": "bot", "content": "x"}]}, 400, "role", id="bad role"
        ),
        pytest.param(
            "chat",
            {**CHAT, "max_tokens": "10"},
            400,
            "max_tokens: must be an integer",
            id="max_tokens a string",
        ),
        pytest.param("chat", {**CHAT, "max_tokens": True}, 400, "max_tokens", id="max_tokens a boolean"),
        pytest.param("chat", {**CHAT, "max_tokens": 0}, 400, "at least 1", id="max_tokens zero"),
        pytest.param("chat", {**CHAT, "temperature": "hot"}, 400, "temperature", id="temperature a string"),
        pytest.param(
            "chat", {**CHAT, "stream": "yes"}, 400, "stream: must be a boolean", id="stream a string"
        ),
        pytest.param(
            "chat",
            {**CHAT, "stream_options": {"include_usage": True}},
            400,
            "only allowed when stream",
            id="stream_options without stream",
        ),
        pytest.param("chat", {**CHAT, "n": 2}, 400, "n=1", id="n above one"),
        pytest.param("chat", {**CHAT, "max_tokens": 990}, 400, "maximum context length", id="too long"),
        pytest.param("completion", {"prompt": ""}, 400, "prompt", id="empty prompt"),
        pytest.param("completion", {}, 400, "prompt", id="no prompt"),
        pytest.param("completion", {"prompt": ["a", "b"]}, 400, "one prompt only", id="two prompts"),
        pytest.param("completion", {"prompt": [1, -2]}, 400, "out of vocabulary", id="negative token id"),
        pytest.param("completion", {"prompt": [2**40]}, 400, "out of vocabulary", id="token id too large"),
        pytest.param("completion", {"prompt": [1, 2.5]}, 400, "token ids", id="float token id"),
        pytest.param("completion", {"prompt": {"text": "x"}}, 400, "prompt", id="prompt an object"),
    ],
)
def test_rejected_requests(kind: str, body: object, status: int, message: str) -> None:
    with pytest.raises(ApiError, match=message) as caught:
        parse(kind, body)
    assert caught.value.status == status
    error = caught.value.body()["error"]
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def events(stream: bytes) -> list:
    assert stream.endswith(b"\n\n")
    frames = stream.split(b"\n\n")[:-1]
    assert all(f.startswith(b"data: ") for f in frames)
    return [json.loads(f[len(b"data: ") :]) for f in frames]


def job(kind: str) -> CompletionJob:
    return CompletionJob(kind, "m-1", [1, 2, 3], 4, True, True)  # type: ignore[arg-type]


def test_chat_stream_chunks_have_openai_shape() -> None:
    writer = ChunkWriter(job("chat"), "chatcmpl-1", created=123)
    stream = (
        writer.role_chunk() + writer.token_chunks(0, 3) + writer.final_chunk(3) + writer.usage_chunk(3, 4, 2)
    )
    chunks = events(stream)
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 123, "model": "m-1"}
    assert all({k: c[k] for k in head} == head for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:5]) == generated_text(4)
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:5]] == [None, None, None, "length"]
    assert chunks[5]["choices"] == []
    assert chunks[5]["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 7,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_completion_stream_chunks_carry_text() -> None:
    writer = ChunkWriter(job("completion"), "cmpl-1")
    assert writer.role_chunk() == b""
    chunks = events(writer.token_chunks(0, 2) + writer.final_chunk(2))
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert "".join(c["choices"][0]["text"] for c in chunks) == generated_text(3)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("kind", "obj"),
    [
        pytest.param("chat", "chat.completion", id="chat"),
        pytest.param("completion", "text_completion", id="completion"),
    ],
)
def test_full_response_has_text_and_usage(kind: str, obj: str) -> None:
    body = full_response(job(kind), "x-1", 4, 2)
    assert body["object"] == obj
    choice = body["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    assert text == generated_text(4)
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    json.dumps(body)
