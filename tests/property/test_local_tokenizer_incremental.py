"""The gateway's prefix-incremental tokenizer (plugin/local_tokenizer.py: pieces cut at added tokens, a
chain cache of block hashes, long pieces encoded in chunks cut at pre-tokenizer boundaries) gives the
ids and block hashes of a whole-text encode, on random chats, cold or extending prompts seen before.

Block size 1 makes the hash chain token-for-token: equal chains mean equal ids. The tokenizers are
bench/toy_model.py's (trained on the spot), with GPT-2's byte-level regex and, swapped in, the Llama 3
and Qwen 2 split patterns, the three pre-tokenizers whose prompts are chunked.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import toy_model
from plugin.local_tokenizer import LocalTokenizer, _last, reference_hashes

MODEL = "m"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _with_split(directory: Path, pattern: str) -> Path:
    """The same model with a Split(pattern) + ByteLevel(no regex) pre-tokenizer, as Llama 3's and Qwen 2's
    tokenizer.json have."""
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


def _indented(seed: int) -> list[str]:
    """Code-like lines (runs of spaces and tabs, digits, newlines), so that the vocabulary has tokens for
    whitespace runs and digit groups: a cut inside a whitespace run would then change the ids."""
    rng, vocab = random.Random(seed), toy_model.words(7)
    return [
        rng.choice(["", "  ", "    ", "\t", "        "]) + toy_model.sentence(rng, vocab, 8)
        + rng.choice(["", "  ", " 42", " 2024", "\n\n", "   \n"]) + "\n"
        for _ in range(400)
    ]  # fmt: skip


INDENTED = _indented(3)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LocalTokenizer]:
    def build(name: str, flavour: str) -> Path:
        return toy_model.build(tmp_path_factory.mktemp(name), flavour, extra_corpus=INDENTED)

    directories = {
        "gpt2-regex/llama3-template": build("gpt2", "llama3"),
        "gpt2-regex/qwen25-template": build("qwen", "qwen25"),
        "llama3-split": _with_split(build("l3", "llama3"), LLAMA3_SPLIT),
        "qwen2-split": _with_split(build("q2", "qwen25"), QWEN2_SPLIT),
    }
    out = {name: LocalTokenizer.load(d) for name, d in directories.items()}
    for tok in out.values():
        assert tok.incremental and tok.chunk_chars  # these tokenizers are cut and chunked
    return out


VOCAB = toy_model.words(7, 300)
# pieces of text whose neighbours make every pre-tokenizer rule fire: words with and without spaces,
# runs of spaces and newlines, digits, contractions, punctuation, non-ASCII letters, added tokens
ATOMS = st.one_of(
    st.sampled_from(VOCAB),
    st.sampled_from(VOCAB).map(" ".__add__),
    st.sampled_from(
        [
            " ",
            "  ",
            "\n",
            "\n\n",
            " \n",
            "\t",
            "\r\n",
            "1",
            "2024",
            "31415926",
            "'s",
            "'T",
            "'re",
            ",",
            ".",
            "!?",
            "--",
            "(",
            ")",
            '"',
            "é",
            "Über",
            "你好",
            "🙂",
            "\u00a0",
            "\u2003",
            "\x1f",
            "<|eot_id|>",
            "<|im_start|>",
            "<|im_end|>",
        ]
    ),
    st.text(max_size=3),
)
TEXTS = st.lists(ATOMS, max_size=60).map("".join)
ROLES = st.sampled_from(["user", "assistant"])
CHATS = st.lists(st.fixed_dictionaries({"role": ROLES, "content": TEXTS}), min_size=1, max_size=6)


def _fresh(tok: LocalTokenizer, chunk_chars: int, thread_min_chars: int = 1 << 30) -> LocalTokenizer:
    """`tok` with empty caches and these settings (loading it again per example takes ~0.1 s)."""
    tok._chains.clear()
    tok._pieces.clear()
    tok._seen.clear()
    tok.chunk_chars, tok.thread_min_chars = chunk_chars, thread_min_chars
    return tok


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(["gpt2-regex/llama3-template", "llama3-split", "qwen2-split"]),
       texts=st.lists(TEXTS, min_size=1, max_size=4), chunk=st.integers(1, 24))  # fmt: skip
def test_chunked_encode_gives_the_ids_of_a_whole_encode(
    tokenizers: dict[str, LocalTokenizer], name: str, texts: list[str], chunk: int
) -> None:
    tok = _fresh(tokenizers[name], chunk)
    pieces = [p for text in texts for p in tok._cut.split(text) if p and not tok._is_added(p)]  # type: ignore[union-attr]
    whole = [tuple(tok.encode(p, False)) for p in pieces]
    assert list(map(tuple, tok._encode(pieces, False))) == whole
    assert list(map(tuple, tok._encode_serial(pieces, False))) == whole
    for p in pieces:
        assert "".join(tok.chunks(p)) == p


ASCII = "".join(map(chr, range(128)))
# the same kinds of neighbours in plain ASCII (the pre-token cache's alphabet), with every ASCII character
ASCII_ATOMS = st.one_of(
    st.sampled_from(VOCAB),
    st.sampled_from(VOCAB).map(" ".__add__),
    st.sampled_from(VOCAB).map(str.upper),
    st.sampled_from([" ", "  ", "   ", "\n", "\n\n", " \n", "\t", "\t\t", "\r\n", "\r", "1", "2024",
                     "31415926", "'s", "'S", "'T", "'re", "'LL", "'d", ",", ".", "!?", "--",
                     "(", ")", '"', "$"]),
    st.text(alphabet=ASCII, max_size=3),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["gpt2-regex/llama3-template", "llama3-split", "qwen2-split"]),
       text=st.lists(ASCII_ATOMS, max_size=80).map("".join),
       max_words=st.sampled_from([1, 4, 1 << 17]))  # fmt: skip
def test_the_pre_token_cache_gives_the_ids_of_a_whole_encode(
    tokenizers: dict[str, LocalTokenizer], name: str, text: str, max_words: int
) -> None:
    """WordEncoder (Python's re split, cached pre-tokens) against the tokenizer's own encode; None for a
    text with a character outside its alphabet (the control characters but tab, newline, return)."""
    words = tokenizers[name].words
    assert words is not None
    words.max_words = max_words  # a small cache starts again while a text is encoded
    ids = words.ids(text)
    if any((c < " " and c not in "\t\n\r") or c == "\x7f" for c in text):
        assert ids is None
    else:
        assert ids is not None and tuple(ids) == tuple(tokenizers[name].encode(text, False))
        assert words.ids(text) == ids  # the cached pre-tokens again


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(["gpt2-regex/llama3-template", "gpt2-regex/qwen25-template", "llama3-split",
                             "qwen2-split"]),
       system=TEXTS, chat=CHATS, generation=st.booleans(), chunk=st.integers(1, 24),
       block=st.sampled_from([1, 16]), cold=st.booleans())  # fmt: skip
def test_prompts_that_extend_seen_ones_hash_like_a_whole_encode(
    tokenizers: dict[str, LocalTokenizer],
    name: str,
    system: str,
    chat: list[dict[str, Any]],
    generation: bool,
    chunk: int,
    block: int,
    cold: bool,
) -> None:
    # cold: every new piece goes through the worker thread (one chunk per call); else on the "loop"
    tok = _fresh(tokenizers[name], chunk, 0 if cold else 1 << 30)
    messages = [{"role": "system", "content": system}, *chat]
    for turn in range(1, len(messages) + 1):  # the chat grows: each prompt extends the one before
        body = {"messages": messages[:turn], "add_generation_prompt": generation}
        expected = reference_hashes(tok, body, MODEL, block)
        got = asyncio.run(tok.blocks_async(body, MODEL, block))
        assert list(got.hashes) == expected
        text, special = tok.prompt_text(body)
        assert got.prompt_tokens == max(1, len(tok.encode(text, special)))
        assert got.cached_tokens <= got.prompt_tokens
        again = tok.blocks(body, MODEL, block)  # the same prompt again: all of it from the caches
        assert list(again.hashes) == expected and again.prompt_tokens == got.prompt_tokens


TOOLS = st.one_of(st.none(), st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]))


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(["gpt2-regex/llama3-template", "gpt2-regex/qwen25-template", "qwen2-split"]),
       system=TEXTS, chat=CHATS, lasts=CHATS, tools=TOOLS, block=st.sampled_from([1, 16]),
       chunk=st.integers(1, 24))  # fmt: skip
def test_a_seen_chat_with_another_last_message_is_rendered_from_it_and_hashes_like_a_whole_encode(
    tokenizers: dict[str, LocalTokenizer],
    name: str,
    system: str,
    chat: list[dict[str, Any]],
    lasts: list[dict[str, Any]],
    tools: Any,
    block: int,
    chunk: int,
) -> None:
    # the benchmark's warm round: a seen chat, sent again with one new message each time
    tok = _fresh(tokenizers[name], chunk)
    seen = [{"role": "system", "content": system}, *chat]
    tok.blocks({"messages": seen, "tools": tools}, MODEL, block)
    for last in lasts:
        body = {"messages": [*seen, last], "tools": tools}
        text = _last(tok._text_steps(body, True))
        assert text.base is not None and text.base.key[1] > 0  # the seen messages are not rendered again
        got = asyncio.run(tok.blocks_async(body, MODEL, block))
        assert list(got.hashes) == reference_hashes(tok, body, MODEL, block)
        assert got.cached_tokens > 0


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(["gpt2-regex/llama3-template", "gpt2-regex/qwen25-template", "llama3-split"]),
       system=TEXTS, chat=CHATS, lasts=CHATS, tools=TOOLS, block=st.sampled_from([1, 16]),
       chunk=st.integers(1, 24))  # fmt: skip
def test_a_seen_chat_with_its_last_message_replaced_hashes_like_a_whole_encode(
    tokenizers: dict[str, LocalTokenizer],
    name: str,
    system: str,
    chat: list[dict[str, Any]],
    lasts: list[dict[str, Any]],
    tools: Any,
    block: int,
    chunk: int,
) -> None:
    # the demo's warm request: the same first messages (a tenant's system prompt), another last one; a
    # template that does not read the next message (Llama 3) renders only the new last message
    tok = _fresh(tokenizers[name], chunk)
    shared = [{"role": "system", "content": system}, *chat[:-1]]
    tok.blocks({"messages": [*shared, chat[-1]], "tools": tools}, MODEL, block)
    for last in lasts:
        body = {"messages": [*shared, last], "tools": tools}
        text = _last(tok._text_steps(body, True))
        if "llama3" in name:  # (Qwen 2.5 reads the next message: rendered whole)
            assert text.base is not None and text.base.key[1] > 0
        got = asyncio.run(tok.blocks_async(body, MODEL, block))
        assert list(got.hashes) == reference_hashes(tok, body, MODEL, block)


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(["gpt2-regex/llama3-template", "gpt2-regex/qwen25-template", "qwen2-split"]),
       system=TEXTS, chat=CHATS, last=CHATS, where=st.integers(0, 6), other=TEXTS,
       parts=st.booleans(), block=st.sampled_from([1, 16]))  # fmt: skip
def test_a_seen_chat_with_an_earlier_message_changed_hashes_like_a_whole_encode(
    tokenizers: dict[str, LocalTokenizer],
    name: str,
    system: str,
    chat: list[dict[str, Any]],
    last: list[dict[str, Any]],
    where: int,
    other: str,
    parts: bool,
    block: int,
) -> None:
    # the message keys must prove that the messages before the seen one are the same, in plain chats
    # (every value a string, keyed in one pass) and in chats with a content-parts message (keyed one by one)
    tok = _fresh(tokenizers[name], 8)
    seen = [{"role": "system", "content": system}, *chat]
    if parts:
        seen[0] = {"role": "system", "content": [{"type": "text", "text": system}]}
    tok.blocks({"messages": seen}, MODEL, block)
    changed = [dict(m) for m in seen]
    j = where % len(changed)
    changed[j]["content"] = other if changed[j]["content"] != other else other + "!"
    for body in ({"messages": [*changed, *last]}, {"messages": [*seen, *last]}, {"messages": changed}):
        got = tok.blocks(body, MODEL, block)
        assert list(got.hashes) == reference_hashes(tok, body, MODEL, block)
