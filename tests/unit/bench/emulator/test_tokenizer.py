"""The fake tokenizer is deterministic across processes, the template shares prefixes, keys chain."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.emulator.tokenizer import (
    ROOT_KEY,
    VOCAB_SIZE,
    TemplateError,
    block_key,
    count_tokens,
    full_block_keys,
    render_chat,
    tokenize,
)

TEXT = "You are a helpful assistant. Ünïcode too: 日本語."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("", 0, id="empty"),
        pytest.param("abc", 1, id="short piece is one token"),
        pytest.param("abcd", 1, id="exactly four chars"),
        pytest.param("abcde", 2, id="five chars"),
        pytest.param("x" * 4000, 1000, id="4000 chars"),
    ],
)
def test_token_count_is_one_per_four_characters(text: str, expected: int) -> None:
    assert len(tokenize(text)) == expected == count_tokens(text)


def test_ids_are_stable_across_processes_with_different_hash_seeds() -> None:
    code = (
        f"import json; from bench.emulator.tokenizer import tokenize, full_block_keys; "
        f"t = tokenize({TEXT!r} * 10); print(json.dumps([t, full_block_keys(t, 16)]))"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        )
        outputs.add(out.stdout)
    tokens = tokenize(TEXT * 10)
    assert outputs == {json.dumps([tokens, full_block_keys(tokens, 16)]) + "\n"}
    assert all(0 <= t < VOCAB_SIZE for t in tokens)
    assert len(set(tokens)) > 5  # not a constant


def test_chat_template_renders_roles_and_generation_prompt() -> None:
    text = render_chat(
        [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_same_system_prompt_and_history_give_the_same_leading_tokens() -> None:
    system = {"role": "system", "content": "You are a pirate. " * 50}
    first = tokenize(render_chat([system, {"role": "user", "content": "Where is the gold?"}]))
    second = tokenize(render_chat([system, {"role": "user", "content": "Who are you?"}]))
    shared = len(render_chat([system])) - len("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert first[: shared // 4] == second[: shared // 4]
    assert first != second
    keys_a, keys_b = full_block_keys(first, 16), full_block_keys(second, 16)
    assert keys_a[: shared // 4 // 16] == keys_b[: shared // 4 // 16]


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        pytest.param([], "non-empty list", id="empty list"),
        pytest.param("hi", "non-empty list", id="not a list"),
        pytest.param([{"role": "wizard", "content": "x"}], "role", id="unknown role"),
        pytest.param(["hello"], "must be an object", id="message not an object"),
        pytest.param([{"role": "user", "content": 5}], "content", id="content a number"),
        pytest.param([{"role": "user", "content": [{"type": "image_url"}]}], "text parts", id="image part"),
    ],
)
def test_chat_template_rejects_malformed_messages(messages: object, error: str) -> None:
    with pytest.raises(TemplateError, match=error):
        render_chat(messages)


@pytest.mark.parametrize(
    ("n_tokens", "n_keys"),
    [
        pytest.param(15, 0, id="partial block only"),
        pytest.param(16, 1, id="one full block"),
        pytest.param(47, 2, id="two full and a partial"),
        pytest.param(48, 3, id="three full"),
    ],
)
def test_only_full_blocks_get_keys(n_tokens: int, n_keys: int) -> None:
    assert len(full_block_keys(list(range(n_tokens)), 16)) == n_keys


def test_keys_chain_from_the_root() -> None:
    tokens = list(range(32))
    first = block_key(ROOT_KEY, tokens[:16])
    assert full_block_keys(tokens, 16) == [first, block_key(first, tokens[16:])]


@settings(max_examples=60, deadline=None)  # no deadline: CI shares 2 cores
@given(
    prefix=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=16, max_size=64),
    tail_a=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=16, max_size=32),
    tail_b=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=16, max_size=32),
)
def test_keys_are_equal_exactly_up_to_the_first_differing_block(
    prefix: list[int], tail_a: list[int], tail_b: list[int]
) -> None:
    a, b = prefix + tail_a, prefix + tail_b
    keys_a, keys_b = full_block_keys(a, 16), full_block_keys(b, 16)
    for i in range(min(len(keys_a), len(keys_b))):
        same_tokens = a[: (i + 1) * 16] == b[: (i + 1) * 16]
        assert (keys_a[i] == keys_b[i]) == same_tokens
        assert 0 <= keys_a[i] < 2**64
