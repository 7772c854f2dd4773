"""The gateway's own tokenizer and chat template (plugin/local_tokenizer.py, plugin/chat_template.py)
against transformers' apply_chat_template + encode, the engine's code path (vLLM calls them).

The model directory is made on the spot (bench/toy_model.py: a BPE tokenizer trained on generated
text, the real Llama 3 and Qwen 2.5 chat templates). Nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import toy_model
from bench.emulator.engine_tokenizer import HfTokenizer
from plugin import local_tokenizer
from plugin.chat_template import TemplateError
from plugin.local_tokenizer import LocalTokenizer, LocalTokenizerError, reference_hashes

pytest.importorskip("transformers")

MODEL = "m"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now"}},  # no description, no parameters
]  # fmt: skip


@pytest.fixture(scope="module", params=["llama3", "qwen25"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return toy_model.build(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> HfTokenizer:
    """The emulated worker's --tokenizer: transformers' apply_chat_template, then encode (vLLM's path)."""
    return HfTokenizer(model_dir)


def conversation(seed: int, turns: int) -> list[dict[str, Any]]:
    rng, vocab = random.Random(seed), toy_model.words(7)
    messages: list[dict[str, Any]] = [{"role": "system", "content": toy_model.sentence(rng, vocab, 40)}]
    for _ in range(turns):
        messages.append(
            {"role": "user", "content": toy_model.sentence(rng, vocab, rng.randint(3, 40)) + " \n"}
        )
        messages.append({"role": "assistant", "content": toy_model.sentence(rng, vocab, rng.randint(3, 30))})
    messages.append({"role": "user", "content": "Go on, then."})
    return messages


BODIES = {
    "plain": {"messages": conversation(1, 4)},
    "tools": {"messages": conversation(2, 2), "tools": TOOLS},
    "no_generation_prompt": {"messages": conversation(3, 1), "add_generation_prompt": False},
    "continue_final": {
        "messages": [*conversation(4, 1), {"role": "assistant", "content": "Well, the"}],
        "continue_final_message": True,
    },
    "tool_calls": {
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": TOOLS,
    },
    "unicode": {"messages": [{"role": "user", "content": "héllo wörld — 你好 🙂 <|not special|>"}]},
}


@pytest.mark.parametrize("case", sorted(BODIES))
def test_ids_and_hashes_match_the_engine(model_dir: Path, reference: HfTokenizer, case: str) -> None:
    body = BODIES[case]
    if case == "tool_calls" and "im_start" not in (model_dir / "tokenizer_config.json").read_text():
        pytest.skip("Llama 3's template has no tool calls")
    tok = LocalTokenizer.load(model_dir)
    assert tok.incremental  # byte-level BPE, plain added tokens: cut at them
    text, special = tok.prompt_text(body)
    assert tok.encode(text, special) == reference.chat(body)
    got = tok.blocks(body, MODEL, 16)
    assert list(got.hashes) == reference_hashes(tok, body, MODEL, 16)
    assert got.prompt_tokens == len(reference.chat(body))


def test_content_parts_are_joined_with_newlines_as_vllm_does(model_dir: Path) -> None:
    tok = LocalTokenizer.load(model_dir)
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]
    }
    joined = {"messages": [{"role": "user", "content": "a\nb"}]}
    assert tok.prompt_text(parts) == tok.prompt_text(joined)


def test_completions_add_the_bos_token_like_the_engine(model_dir: Path, reference: HfTokenizer) -> None:
    tok = LocalTokenizer.load(model_dir)
    body = {"prompt": "Once upon a time there was a prompt."}
    got = tok.blocks(body, MODEL, 4)
    ids = reference.text(body["prompt"])  # special tokens added, as /v1/completions does
    assert got.prompt_tokens == len(ids)
    assert list(got.hashes) == reference_hashes(tok, body, MODEL, 4)


def test_a_growing_chat_reuses_the_seen_prefix_and_stays_exact(model_dir: Path) -> None:
    tok = LocalTokenizer.load(model_dir)
    full = conversation(9, 12)
    before = 0
    for turns in range(1, 12):
        # each turn: the history so far (with the model's answers), a new user message
        body = {"messages": [*full[: 1 + 2 * turns], {"role": "user", "content": f"turn {turns}?"}]}
        got = tok.blocks(body, MODEL, 16)
        assert list(got.hashes) == reference_hashes(tok, body, MODEL, 16)
        # all but the last turn's question and generation prompt came from the chain cache
        assert got.cached_tokens >= before - 24, turns
        before = got.prompt_tokens


def test_block_sizes_have_their_own_chains(model_dir: Path) -> None:
    tok = LocalTokenizer.load(model_dir)
    body = BODIES["plain"]
    for size in (16, 4, 16, 32):
        assert list(tok.blocks(body, MODEL, size).hashes) == reference_hashes(tok, body, MODEL, size)


async def test_async_path_equals_the_sync_one(model_dir: Path) -> None:
    cold, warm = LocalTokenizer.load(model_dir), LocalTokenizer.load(model_dir)
    rng, vocab = random.Random(5), toy_model.words(7)
    long_body = {"messages": [{"role": "user", "content": toy_model.sentence(rng, vocab, 3000)}]}
    expected = cold.blocks(long_body, MODEL, 16)  # long enough for the worker thread
    got = await warm.blocks_async(long_body, MODEL, 16)
    assert got.hashes == expected.hashes and got.prompt_tokens == expected.prompt_tokens


def test_bad_requests_raise_template_errors(model_dir: Path) -> None:
    tok = LocalTokenizer.load(model_dir)
    for body in (
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        {"prompt": [[1, 2], [3]]},
    ):
        with pytest.raises(TemplateError):
            tok.prompt_text(body)


def test_template_raise_exception_is_a_template_error(tmp_path: Path) -> None:
    directory = toy_model.build(tmp_path, "llama3")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = LocalTokenizer.load(directory)
    with pytest.raises(TemplateError, match="user first"):
        tok.prompt_text({"messages": [{"role": "assistant", "content": "x"}]})
    assert tok.prompt_text({"messages": [{"role": "user", "content": "x"}]})[0] == "x"


def test_a_missing_or_broken_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LocalTokenizerError, match=r"tokenizer\.json"):
        LocalTokenizer.load(tmp_path)
    directory = toy_model.build(tmp_path / "m", "llama3")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(LocalTokenizerError, match="does not parse"):
        LocalTokenizer.load(directory)


def test_only_known_pre_tokenizers_are_chunked(tmp_path: Path) -> None:
    """Chunking a piece at spaces is exact only for the pre-tokenizers whose split rule makes such a space
    a boundary (tests/property/test_local_tokenizer_incremental.py); any other one encodes pieces whole."""
    directory = toy_model.build(tmp_path, "llama3")
    assert LocalTokenizer.load(directory).chunk_chars > 0  # GPT-2's byte-level regex
    spec = json.loads((directory / "tokenizer.json").read_text())
    others = [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        {"type": "Whitespace"},
        {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\s+|\w+"}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
    ]  # fmt: skip
    for pre in others:
        (directory / "tokenizer.json").write_text(json.dumps({**spec, "pre_tokenizer": pre}))
        tok = LocalTokenizer.load(directory)
        assert tok.chunk_chars == 0, pre
        long = "word " * 2000
        assert tok.chunks(long) == [long]


async def test_the_pacer_yields_only_after_its_first_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work shorter than FIRST_SLICE_S (a warm prompt) runs without yielding, since each yield waits
    behind the other flows; longer work yields every LOOP_SLICE_S from then on."""
    clock = [100.0]
    monkeypatch.setattr(local_tokenizer.time, "perf_counter", lambda: clock[0])
    yields = []
    sleep = asyncio.sleep

    async def counted(delay: float) -> None:
        yields.append(clock[0])
        await sleep(delay)

    monkeypatch.setattr(local_tokenizer.asyncio, "sleep", counted)
    step = 0.0001

    def steps(n: int) -> Iterator[int | None]:
        for _ in range(n):
            clock[0] += step
            yield None
        yield n

    assert await local_tokenizer._Pacer().run(steps(9)) == 9  # 0.9 ms of work: a warm prompt
    assert yields == []
    start = clock[0]
    await local_tokenizer._Pacer().run(steps(40))  # 4 ms: a cold one
    assert yields[0] == pytest.approx(start + 0.001)  # after 1 ms, then every 0.25 ms (3 steps here)
    assert len(yields) == 1 + (40 - 10) // 3
