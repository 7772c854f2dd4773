"""The gateway's memoized prefix hasher agrees with policy.prefix on every input, memo hit or miss."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.prefix_memo import PromptHasher, hash_prompt
from policy.prefix import text_block_hashes

# a few shared "system prompts" so that later texts hit steps memoized by earlier ones
PREFIXES = ["", "You are a helpful assistant. " * 20, "Ünïcödé prefix ✓ " * 15]
texts = st.builds(
    lambda prefix, tail: prefix + tail,
    st.sampled_from(PREFIXES),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=300),
)


@settings(max_examples=150, deadline=None)
@given(
    batch=st.lists(texts, min_size=1, max_size=6),
    chunk_chars=st.integers(1, 96),
    max_blocks=st.integers(1, 40),
    model=st.sampled_from(["m", "other-model"]),
    max_bytes=st.sampled_from([1, 200, 1 << 20]),
)
def test_block_hashes_equal_policy(
    batch: list[str], chunk_chars: int, max_blocks: int, model: str, max_bytes: int
) -> None:
    hasher = PromptHasher(max_bytes=max_bytes)
    for text in batch + batch:  # the second pass runs on a warm memo
        got = hasher.block_hashes(text, model=model, chunk_chars=chunk_chars, max_blocks=max_blocks)
        assert got == text_block_hashes(text, model=model, chunk_chars=chunk_chars, max_blocks=max_blocks)
        # bounded: over the limit only by the steps of one text (kept even when they alone exceed it)
        own = len(text[: chunk_chars * max_blocks].encode()) + 8 * len(got[0])
        assert hasher._bytes == sum(map(len, hasher._steps)) <= max(max_bytes, own)


@pytest.mark.parametrize(
    "body",
    [
        {
            "model": "m",
            "messages": [{"role": "system", "content": PREFIXES[1]}, {"role": "user", "content": "hi"}],
        },
        {"model": "m", "prompt": PREFIXES[2] + "tail"},
        {"model": "m", "prompt": [1, 2, 3]},
    ],
    ids=["chat", "completion-text", "completion-tokens"],
)
def test_hash_prompt_equals_routing(body: dict[str, object]) -> None:
    hasher = PromptHasher()
    for _ in range(2):
        assert hasher.hash_prompt(body, "m", 64) == hash_prompt(body, "m", 64)


@pytest.mark.parametrize(
    "bad", [{"model": "m"}, {"model": "m", "messages": []}], ids=["no-prompt", "no-messages"]
)
def test_bad_shapes_raise_value_error(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PromptHasher().hash_prompt(bad, "m", 64)


def test_memo_stays_bounded() -> None:
    hasher = PromptHasher(max_bytes=2000)
    for i in range(200):
        hasher.block_hashes(f"text {i} " * 20, model="m", chunk_chars=16)
        assert hasher._bytes == sum(map(len, hasher._steps)) <= 2000


# texts that share leading chunks with recent ones in every way: grown (a conversation's next turn),
# cut, diverging inside a chunk or at a boundary, with other limits
growth = st.lists(
    st.tuples(st.integers(0, 400), st.text(alphabet="abé✓ ", max_size=120)), min_size=1, max_size=8
)


@settings(max_examples=150, deadline=None)
@given(
    steps=growth,
    chunk_chars=st.integers(1, 48),
    max_blocks=st.lists(st.integers(1, 30), min_size=1, max_size=3),
    max_bytes=st.sampled_from([1, 300, 1 << 20]),
)
def test_recent_prefixes_give_the_policy_hashes(
    steps: list[tuple[int, str]], chunk_chars: int, max_blocks: list[int], max_bytes: int
) -> None:
    hasher = PromptHasher(max_bytes=max_bytes)
    text = "You are a helpful assistant. " * 8
    for i, (keep, tail) in enumerate(steps):
        text = text[:keep] + tail if keep < len(text) else text + tail
        limit = max_blocks[i % len(max_blocks)]
        got = hasher.block_hashes(text, model="m", chunk_chars=chunk_chars, max_blocks=limit)
        assert got == text_block_hashes(text, model="m", chunk_chars=chunk_chars, max_blocks=limit)
    assert hasher._recent_chars == sum(len(r.pieces) * chunk_chars for r in hasher._recent.values())
