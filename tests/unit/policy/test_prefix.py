"""policy/prefix.py: canonical rendering of OpenAI requests and chained block hashes."""

from __future__ import annotations

import json

import pytest

from policy.prefix import text_block_hashes, token_block_hashes
from policy.request import canonical_text

SYSTEM = {"role": "system", "content": "You are a helpful assistant." * 20}


def chat(*messages: dict[str, object], **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": list(messages), **extra}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(chat({"role": "user", "content": "hi"}), "<|user|>hi\n", id="plain user message"),
        pytest.param(
            chat({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            "<|user|>ab\n",
            id="text parts join like a string",
        ),
        pytest.param(
            chat(
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}]}
            ),
            "<|user|><image:http://x/i.png>\n",
            id="image reference",
        ),
        pytest.param(
            chat({"role": "user", "name": "bob", "content": "x"}), "<|user name=bob|>x\n", id="name"
        ),
        pytest.param(
            chat(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a":1}'}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ),
            '<|assistant|><call c1 f>{"a":1}\n<|tool call=c1|>42\n',
            id="tool call and its result",
        ),
        pytest.param(
            chat({"role": "user", "content": "q"}, tools=[{"type": "function", "function": {"name": "f"}}]),
            '<|tools|>[{"function":{"name":"f"},"type":"function"}]\n<|user|>q\n',
            id="tools come first like a system prompt",
        ),
        pytest.param({"prompt": "once upon"}, "once upon", id="completion string"),
        pytest.param({"prompt": ["a", "b"]}, "a\nb", id="completion list of strings"),
        pytest.param({"prompt": [1, 2, 3]}, "<tokens:1,2,3>", id="completion token ids"),
    ],
)
def test_canonical_text(body: dict[str, object], expected: str) -> None:
    assert canonical_text(body) == expected


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"model": "m"}, "neither", id="no messages or prompt"),
        pytest.param({"messages": []}, "messages", id="empty messages"),
        pytest.param({"messages": "hi"}, "messages", id="messages not a list"),
        pytest.param({"messages": [{"content": "x"}]}, "messages[0].role", id="missing role"),
        pytest.param({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", id="bad role"),
        pytest.param({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", id="bad content"),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "content[0]", id="part without type"
        ),
        pytest.param(
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
            "tool_calls[0]",
            id="tool call without name",
        ),
        pytest.param({"prompt": 7}, "prompt", id="prompt not text"),
        pytest.param({"prompt": [1, "a"]}, "prompt", id="mixed prompt list"),
    ],
)
def test_invalid_requests_raise_value_error_naming_the_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        canonical_text(body)


def test_key_order_and_whitespace_do_not_matter() -> None:
    body = chat(
        SYSTEM, {"role": "user", "content": "q"}, tools=[{"type": "function", "function": {"name": "f"}}]
    )
    reordered = json.loads(json.dumps(body, indent=3, sort_keys=True))
    assert canonical_text(reordered) == canonical_text(body)


def test_same_history_gives_same_leading_text_and_blocks() -> None:
    turn1 = chat(SYSTEM, {"role": "user", "content": "first question " * 30})
    turn2 = chat(
        *turn1["messages"], {"role": "assistant", "content": "answer"}, {"role": "user", "content": "2"}
    )
    t1, t2 = canonical_text(turn1), canonical_text(turn2)
    assert t2.startswith(t1)
    h1, _ = text_block_hashes(t1, model="m", chunk_chars=64)
    h2, _ = text_block_hashes(t2, model="m", chunk_chars=64)
    full = len(t1) // 64
    assert full >= 2 and h1[:full] == h2[:full]


@pytest.mark.parametrize(
    ("length", "chunk", "max_blocks", "blocks", "tokens"),
    [
        pytest.param(0, 256, 512, 0, (), id="empty text has no blocks"),
        pytest.param(256, 256, 512, 1, (64,), id="one full chunk"),
        pytest.param(300, 256, 512, 2, (64, 11), id="tail chunk included, ceil tokens"),
        pytest.param(1000, 100, 3, 3, (25, 25, 25), id="capped at max_blocks"),
    ],
)
def test_text_block_hashes_shape(
    length: int, chunk: int, max_blocks: int, blocks: int, tokens: tuple[int, ...]
) -> None:
    hashes, block_tokens = text_block_hashes(
        "x" * length, model="m", chunk_chars=chunk, max_blocks=max_blocks
    )
    assert len(hashes) == blocks and block_tokens == tokens
    assert all(0 <= h < 2**64 for h in hashes)


def test_text_hashes_are_chained_and_seeded_by_model() -> None:
    a, _ = text_block_hashes("A" * 64 + "B" * 64, model="m", chunk_chars=64)
    b, _ = text_block_hashes("C" * 64 + "B" * 64, model="m", chunk_chars=64)
    c, _ = text_block_hashes("A" * 64 + "B" * 64, model="other", chunk_chars=64)
    assert a[1] != b[1], "same chunk after a different prefix must hash differently"
    assert a[0] != c[0], "models never share entries"


def test_non_ascii_text_hashes_by_characters() -> None:
    hashes, tokens = text_block_hashes("é" * 300, model="m", chunk_chars=256)
    assert len(hashes) == 2 and tokens == (64, 11)


@pytest.mark.parametrize(
    ("n_tokens", "block", "blocks"),
    [
        pytest.param(0, 16, 0, id="empty"),
        pytest.param(15, 16, 0, id="partial block is not hashed"),
        pytest.param(33, 16, 2, id="full blocks only"),
    ],
)
def test_token_block_hashes(n_tokens: int, block: int, blocks: int) -> None:
    hashes, sizes = token_block_hashes(list(range(n_tokens)), model="m", block_size=block)
    assert len(hashes) == blocks and sizes == (block,) * blocks


def test_token_hashes_share_leading_blocks() -> None:
    a, _ = token_block_hashes([1] * 32 + [2] * 16, model="m")
    b, _ = token_block_hashes([1] * 32 + [3] * 16, model="m")
    assert a[:2] == b[:2] and a[2] != b[2]


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError):
        text_block_hashes("x", model="m", chunk_chars=0)
    with pytest.raises(ValueError):
        token_block_hashes([1], model="m", block_size=0)
