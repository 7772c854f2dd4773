"""Exact mode without a round trip: a model's own tokenizer and chat template in the gateway.

`LocalTokenizer.load(dir)` reads `tokenizer.json` (the `tokenizers` library, the Rust tokenizer vLLM's
fast tokenizers wrap) and `tokenizer_config.json` (chat template, special tokens) from a local model
directory; nothing is downloaded. Token ids are those vLLM computes: chat requests are rendered with
the template (plugin/chat_template.py) and encoded without special tokens (vLLM's chat default);
completions prompts are encoded with them (the tokenizer's post-processor adds BOS, as
`/v1/completions` does); `add_special_tokens` in the body overrides both.

Prefix-incremental: the rendered text is cut at the tokenizer's added tokens (`<|eot_id|>`,
`<|im_start|>`, ...), which the tokenizer itself splits on before anything else, so the ids of the
whole text are the ids of the pieces in order. A chain cache keyed by a hash of the text up to each
cut keeps the block-hash chain there (hashes, pending tokens of the unfinished block, token count), so
a prompt that extends a seen one (the next turn of a chat, a shared system prompt and tools) tokenizes
and hashes only the text after the longest seen cut. A piece cache (piece text -> ids) serves pieces
seen after a different prefix. With a chat template of the message-local form (plugin/chat_template.py
`compile_from`) and added tokens that neither overlap nor contain one another (`_splits_locally`), a chat
is rendered only from the last message whose prefix was seen: `_seen` keeps, under a hash of the
messages up to a message and of the rest of what the template reads, the cut key where that message's
text started, so the render, the cut and the lookup skip the seen messages (with a 30k-token seen
prefix, ~1.8 ms of the loop's time became ~0.6 ms; docs/BENCHMARKS.md). With a template that never reads
the next message (`chat_template.reads_ahead`), the key is that of the messages before it, so a chat
sharing only its first messages with a seen one (a system prompt, then a new question) skips them too.
If that key's chain is no longer cached, the text is rendered whole. A tokenizer whose added tokens
strip neighbouring whitespace, match only whole words, or match normalized text, or whose pre-tokenizer
depends on the position in the input (Metaspace `prepend_scheme = "first"`), is not cut: its prompts are
encoded whole (exact, not incremental).

Long new pieces are cut again, into chunks of about `CHUNK_CHARS`, where the pre-tokenizer splits
anyway: at a space after a printable ASCII character and before an ASCII letter, for the pre-tokenizers
whose split rule makes that a boundary whatever comes before or after (GPT-2's byte-level regex, the
Llama 3 / cl100k and Qwen 2 split patterns; no normalizer, no prefix space, deterministic BPE). The ids of
a piece are the ids of its chunks in order, so the chunks of a warm prompt's new message are encoded in
one parallel `encode_batch` (tests/property/test_local_tokenizer_incremental.py checks both cuts against
a whole-text encode).

Event loop: `blocks_async` runs on the loop and yields to it every ~0.25 ms of its own work
(`LOOP_SLICE_S`), the first time after ~1 ms (`FIRST_SLICE_S`: a warm prompt does not yield): the chat
template renders there (jinja2 generates it a message at a time), then the cut and the cache lookup,
then the hashing, 32 blocks between two looks at the clock. New text under 16k
characters in all (a warm prompt's tail) is encoded on the loop: its plain ASCII through the pre-token
cache (plugin/word_encoder.py, ~0.7-1.2 ms for 2k tokens, the library took ~3-6 ms), the rest in one
tokenizer call.
More than that (a cold prompt) goes to the one encoder thread, where cold prompts take turns; it encodes
one chunk per `encode_batch_fast` call, and a batch of one runs on the calling thread with the GIL
released. So the encoder keeps at most one core busy and leaves the other to the loop, and holds the GIL
only to build each chunk's ids (measured: `kvgate bench tokenize`, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from hashlib import blake2b
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar

import jinja2
from cachetools import LRUCache
from tokenizers import Tokenizer as HfTokenizer

from plugin import word_encoder
from plugin.chat_template import (
    FROM_VAR,
    Rendering,
    TemplateError,
    compile_from,
    compile_template,
    reads_ahead,
    render,
    special_tokens,
)
from policy.prefix import token_block_hashes

LOOP_SLICE_S = 0.00025  # blocks_async works on the loop about this long between two yields
# ... except before its first yield: a prompt whose work on the loop is shorter (a warm one) never yields,
# since each yield waits behind the other flows' ready work (docs/BENCHMARKS.md, issue 13 session 9)
FIRST_SLICE_S = 0.001
HASH_STEP_BLOCKS = 32  # blocks hashed between two checks of the time (~0.05-0.15 ms)
THREAD_MIN_CHARS = 16_384  # this much new text (~4k tokens, >1.5 ms) is encoded in a worker thread
CHUNK_CHARS = 1024  # a piece twice as long is encoded in chunks of about this size (module docstring)
PARALLEL_MIN_CHUNKS = 4  # encode_batch spreads a batch over its threads from about 4 texts on
# cold prompts are encoded on this one thread, in turn: the encoder never takes more than one core from
# the loop, however many cold prompts arrive together (its thread starts when the first tokenizer loads)
_ENCODER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-encoder")
# a boundary of the pre-tokenizers below whatever surrounds it: " " + letter, after a printable character
_SAFE_CUT = re.compile(r"(?<=[!-~]) (?=[A-Za-z])")
# Split patterns (tokenizer.json) for which _SAFE_CUT is a boundary: Llama 3 / cl100k, Qwen 2
_CHUNKABLE_SPLITS = frozenset(word_encoder.SPLITS)


_T = TypeVar("_T")


def _ids(parts: Iterable[array[int]]) -> array[int]:
    """Token ids (an array("I"), as they are kept throughout: joined and hashed without a Python loop)."""
    out = array("I")
    out.frombytes(b"".join(parts))
    return out


def _hash_ints(digests: list[bytes]) -> list[int]:
    """The 8-byte block digests as policy.prefix's ints (little-endian), in one conversion."""
    ints = array("Q", b"".join(digests))
    if sys.byteorder != "little":
        ints.byteswap()
    return ints.tolist()


class LocalTokenizerError(ValueError):
    """A model directory that cannot be loaded (missing or bad tokenizer.json / tokenizer_config.json)."""


@dataclass(frozen=True, slots=True)
class _Chain:
    """The block-hash chain after a cut: `hashes[:n]` are the full blocks so far (shared list)."""

    hashes: list[int]
    n: int
    last: bytes  # chain state after block n (the model seed when n == 0)
    pending: array[int]  # ids after the last full block (never changed: a new array each time)
    tokens: int  # ids so far


@dataclass(frozen=True, slots=True)
class LocalBlocks:
    hashes: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int  # ids that came from the chain cache (not encoded or hashed again)


def _seed(model: str) -> bytes:
    return blake2b(b"kvgate\x00" + model.encode(), digest_size=8).digest()


def _incremental_ok(spec: Mapping[str, Any]) -> bool:
    """Whether encoding the pieces between added tokens equals encoding the whole text (tokenizer.json)."""
    for added in spec.get("added_tokens") or ():
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            return False
        if added.get("normalized") and spec.get("normalizer") is not None:
            return False
    return '"prepend_scheme": "first"' not in json.dumps(spec.get("pre_tokenizer"))


def _chunkable(spec: Mapping[str, Any]) -> bool:
    """Whether a piece may be encoded in chunks cut at _SAFE_CUT (module docstring): the pre-tokenizer is
    GPT-2's byte-level regex, or a known Split pattern then byte level, with nothing position-dependent."""
    model = spec.get("model") or {}
    if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("dropout"):
        return False
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return bool(pre.get("use_regex", True)) and not pre.get("add_prefix_space", True)
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2:
        return False
    split, byte_level = steps
    return (
        split.get("type") == "Split"
        and (split.get("pattern") or {}).get("Regex") in _CHUNKABLE_SPLITS
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex", True)
        and not byte_level.get("add_prefix_space", True)
    )


def _splits_locally(added: Sequence[str]) -> bool:
    """Whether no added token is inside another or overlaps one: then every occurrence is a cut, so text
    that ends with an added token (or a text that starts with one) is cut the same alone as before more."""
    heads = {t[:i] for t in added for i in range(1, len(t))}
    for t in added:
        if any(t[i:] in heads for i in range(1, len(t))) or any(t != u and t in u for u in added):
            return False
    return True


def _frozen(value: Any) -> Any:
    """A hashable copy of JSON data that tells apart what renders differently (1, 1.0, True; key order)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return ("d", *((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("l", *map(_frozen, value))
    return (type(value).__name__, value)


@dataclass(frozen=True, slots=True)
class _Seen:
    """Where a message's text started in a prompt seen before: the cut key there (chain hash, characters)
    and whether an added token ends the text before it."""

    key: tuple[int, int]
    after_added: bool


@dataclass(slots=True)
class _Text:
    """The text to cut: the whole prompt, or (`base` set) the part after a seen message prefix."""

    text: str
    special: bool
    base: _Seen | None = None
    memo: dict[int, int] = field(default_factory=dict)  # characters -> key of the messages up to there


class LocalTokenizer:
    """One model's tokenizer + chat template, with the chain and piece caches (module docstring)."""

    def __init__(
        self,
        tokenizer: HfTokenizer,
        config: Mapping[str, Any],
        *,
        chain_entries: int = 16_384,
        piece_tokens: int = 4_000_000,
        chunk_chars: int = CHUNK_CHARS,
        thread_min_chars: int = THREAD_MIN_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
            source = named.get("default")
        self.template: jinja2.Template | None = (
            compile_template(source) if isinstance(source, str) and source else None
        )
        self.specials = special_tokens(config)
        added = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()), key=len)
        spec = json.loads(tokenizer.to_str())
        self.incremental = bool(added) and _incremental_ok(spec)
        self.chunk_chars = chunk_chars if self.incremental and _chunkable(spec) else 0
        # a warm prompt's new ASCII text is split in Python and its pre-tokens' ids come from a cache
        # (plugin/word_encoder.py): the tokenizer's regex pass was most of a warm round
        self.words = word_encoder.WordEncoder.for_tokenizer(tokenizer, spec) if self.chunk_chars else None
        self.thread_min_chars = thread_min_chars
        _ENCODER.submit(int)  # starts the encoder thread now, not on the first cold request
        # the same ids without offsets, ~25 % less CPU but on one thread (tokenizers >= 0.21, measured
        # with 0.23.3); both release the GIL
        self._fast: Any = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self._cut = re.compile("(" + "|".join(re.escape(t) for t in reversed(added)) + ")") if added else None
        self._added_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        # rendering from a seen message on (chat_template.compile_from): where each message's text
        # started in prompts seen before, keyed by the messages up to and including it
        self.template_from: jinja2.Template | None = None
        if self.template is not None and self.incremental and _splits_locally(added):
            self.template_from = compile_from(source) if isinstance(source, str) else None
        # where message j's text starts is kept under the key of messages[:j + 1], or of messages[:j]
        # when the template never reads the next message (chat_template.reads_ahead): then a chat that
        # shares its first messages with a seen one and differs from there on (a shared system prompt and
        # a new question) is rendered from its first new message
        self._key_back = 1 if isinstance(source, str) and not reads_ahead(source) else 0
        self._seen: LRUCache[int, _Seen] = LRUCache(maxsize=max(1, chain_entries))
        self._chains: LRUCache[tuple[tuple[int, int], int, str], _Chain] = LRUCache(
            maxsize=max(1, chain_entries)
        )
        self._pieces: LRUCache[str, array[int]] = LRUCache(maxsize=max(1, piece_tokens), getsizeof=len)

    @classmethod
    def load(cls, directory: str | Path, **caches: int) -> LocalTokenizer:
        path = Path(directory)
        try:
            tokenizer = HfTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust side raises plain Exception for a bad or missing file
            raise LocalTokenizerError(f"{path / 'tokenizer.json'}: {e}") from None
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.exists():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as e:
                raise LocalTokenizerError(f"{config_file}: {e}") from None
        template_file = path / "chat_template.jinja"  # newer checkpoints keep the template apart
        if "chat_template" not in config and template_file.exists():
            config["chat_template"] = template_file.read_text()
        try:
            return cls(tokenizer, config, **caches)
        except TemplateError as e:
            raise LocalTokenizerError(f"{path}: {e}") from None

    # -- text ------------------------------------------------------------------------------------------
    def prompt_text(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        """(text, add_special_tokens) of a chat or completions body; TemplateError if unsupported."""
        if "messages" in body:
            if self.template is None:
                raise TemplateError("the model directory has no chat template")
            return render(self.template, body, self.specials), bool(body.get("add_special_tokens", False))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise TemplateError("prompt: only a single text prompt is tokenized locally")
        return prompt, bool(body.get("add_special_tokens", True))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The tokenizer's ids of `text` (the reference the incremental path must equal)."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    # -- blocks ----------------------------------------------------------------------------------------
    async def blocks_async(self, body: Mapping[str, Any], model: str, block_size: int) -> LocalBlocks:
        """Token-block hashes of a request (policy.prefix.token_block_hashes of its ids)."""
        pacer = _Pacer()
        text = await pacer.run(self._text_steps(body, True))
        plan = await pacer.run(self._plan_steps(text, block_size, model))
        if plan.chain is None and text.base is not None:  # the seen messages' chain is gone: whole text
            text = await pacer.run(self._text_steps(body, False))
            plan = await pacer.run(self._plan_steps(text, block_size, model))
        ids: list[array[int]] = []
        special = text.special
        if plan.new and sum(map(len, plan.new)) >= self.thread_min_chars:  # cold: off the loop, one core
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(_ENCODER, self._encode_serial, plan.new, special)
            pacer.since = time.perf_counter()
        elif plan.new:  # a warm prompt's tail: on the loop, its chunks in parallel
            ids = self._encode(plan.new, special)
        plan.fresh.update(zip(plan.new, ids, strict=True))
        self._remember(plan)
        return await pacer.run(self._extend(plan, model, block_size))

    def blocks(self, body: Mapping[str, Any], model: str, block_size: int) -> LocalBlocks:
        """`blocks_async` on the caller's thread, without yielding (tests, benchmarks)."""
        text = _last(self._text_steps(body, True))
        plan = _last(self._plan_steps(text, block_size, model))
        if plan.chain is None and text.base is not None:
            text = _last(self._text_steps(body, False))
            plan = _last(self._plan_steps(text, block_size, model))
        if plan.new:
            plan.fresh.update(zip(plan.new, self._encode(plan.new, text.special), strict=True))
            self._remember(plan)
        return _last(self._extend(plan, model, block_size))

    def _text_steps(self, body: Mapping[str, Any], memo: bool) -> Iterator[_Text | None]:
        """The text to cut, in steps (None between them: the template renders a message at a time).
        With a template of the message-local form and `memo`, it is rendered from the last message
        whose prefix was seen (its cut key kept in `_seen`), and the text is what follows."""
        if "messages" not in body or self.template is None:
            yield _Text(*self.prompt_text(body))
            return
        special = bool(body.get("add_special_tokens", False))
        template = self.template if special or self.template_from is None else self.template_from
        rendering = Rendering(template, body, self.specials)
        keys: list[int] = []
        start, base = 0, None
        if template is self.template_from:
            keys = self._message_keys(rendering)
            back = self._key_back
            for j in range(len(keys) - 1, 0, -1) if memo else ():
                found = self._seen.get(keys[j - back])
                if found is not None:
                    start, base = j, found
                    break
            rendering.context[FROM_VAR] = start
        parts: list[str] = []
        for part in rendering.parts():
            parts.append(part)
            yield None
        text = rendering.finish("".join(parts))
        marks = rendering.marks
        offset = 0
        if base is not None:
            offset = marks.get(start, -1)
            cut = self._cut
            if offset < 0 or not (base.after_added or (cut is not None and cut.match(text, offset))):
                yield from self._text_steps(body, False)  # not a cut there: the whole text
                return
            text = text[offset:]
        out = _Text(text, special, base)
        begin = base.key[1] if base is not None else 0
        for j in (len(keys) - 1, len(keys) - 2):  # kept for the next turn, and for a new last message
            if j >= 1 and j in marks:
                out.memo[begin + marks[j] - offset] = keys[j - self._key_back]
        yield out

    def _message_keys(self, rendering: Rendering) -> list[int]:
        """Per message, a hash of the messages up to it and of everything else the template reads."""
        context = rendering.context
        key = hash(
            (
                _frozen([context.get(k) for k in ("tools", "documents", "add_generation_prompt")]),
                _frozen({k: v for k, v in context.items() if k not in ("messages", "tools", "documents")
                         and not callable(v)}),
                rendering.cont,
            )
        )  # fmt: skip
        messages = rendering.messages
        if rendering.plain:  # every value a string: each message's items as they are, hashed in one pass
            hashes: Iterable[int] = map(hash, map(tuple, map(dict.items, messages)))
        else:
            hashes = (
                hash(tuple(m.items())) if all(type(v) is str for v in m.values()) else hash(_frozen(m))
                for m in messages
            )
        keys = []
        for message_hash in hashes:
            key = hash((key, message_hash))
            keys.append(key)
        return keys

    def chunks(self, piece: str, special: bool = False) -> list[str]:
        """`piece` cut at _SAFE_CUT into chunks of about chunk_chars (whole if it is not chunkable)."""
        size = self.chunk_chars
        if not size or special or len(piece) < 2 * size:
            return [piece]
        out, start, search = [], 0, size
        while search < len(piece) - size // 2:
            cut = _SAFE_CUT.search(piece, search)
            if cut is None or cut.start() >= len(piece) - size // 2:
                break
            out.append(piece[start : cut.start()])
            start = cut.start()
            search = start + size
        out.append(piece[start:])
        return out

    def _encode(self, pieces: Sequence[str], special: bool) -> list[array[int]]:
        """The ids of each piece, on the calling thread. Plain ASCII text (a piece, else a chunk of it)
        goes through the pre-token cache (`words`); the other chunks go to one tokenizer call:
        encode_batch from PARALLEL_MIN_CHUNKS on (it spreads them over the tokenizer's threads), else
        encode_batch_fast (one thread, less CPU). Both release the GIL, plain encode does not."""
        words = None if special else self.words
        whole = [words.ids(p) for p in pieces] if words is not None else [None] * len(pieces)
        chunked = [self.chunks(p, special) for p, ids in zip(pieces, whole, strict=True) if ids is None]
        known: dict[str, array[int]] = {}
        if words is not None:
            for chunk in chain.from_iterable(chunked):
                ids = words.ids(chunk)
                if ids is not None:
                    known[chunk] = ids
        rest = [c for c in dict.fromkeys(chain.from_iterable(chunked)) if c not in known]
        if rest:
            batch = self.tokenizer.encode_batch if len(rest) >= PARALLEL_MIN_CHUNKS else self._fast
            known.update(
                zip(rest, (array("I", e.ids) for e in batch(rest, add_special_tokens=special)), strict=True)
            )
        joined = (_ids(map(known.__getitem__, chunks)) for chunks in chunked)
        return [ids if ids is not None else next(joined) for ids in whole]

    def _encode_serial(self, pieces: Sequence[str], special: bool) -> list[array[int]]:
        """`_encode` one chunk per call (for a worker thread): a batch of one is encoded on the calling
        thread with the GIL released, so the encoder takes one core and the loop keeps the other."""
        encode = self._fast
        out = []
        for piece in pieces:
            ids = array("I")
            for chunk in self.chunks(piece, special):
                ids.extend(encode([chunk], add_special_tokens=special)[0].ids)
            out.append(ids)
        return out

    def _remember(self, plan: _Plan) -> None:
        if plan.keys and plan.keys[0] is not None:  # incremental: pieces are worth keeping
            for text in plan.new:
                self._pieces[text] = plan.fresh[text]

    def _plan_steps(self, text: _Text, block_size: int, model: str) -> Iterator[_Plan | None]:
        """Cut the text, find the longest cached chain, and list the pieces after it still to encode; in
        three steps of ~0.1-0.4 ms for a 32k-token prompt: None between them, then the plan. Keeps the
        cut keys at the text's message starts (`text.memo`) in `_seen`."""
        if not self.incremental or self._cut is None or text.special:
            # special tokens come from the post-processor: only a whole-text encode knows where they go
            yield _Plan([text.text], [None], None, [text.text])
            return
        pieces = [p for p in self._cut.split(text.text) if p]
        yield None
        # key of the text up to each cut: a chain of Python's (SipHash) str hashes, with the length
        # checked on a hit; the pieces' hashes are cached on the str objects for the lookups below
        keys: list[tuple[int, int]] = []
        key, length = text.base.key if text.base is not None else (0, 0)
        memo = text.memo
        if length in memo and text.base is not None:
            self._seen[memo[length]] = text.base
        for piece in pieces:
            length += len(piece)
            key = hash((key, piece))
            keys.append((key, length))
            if length in memo:
                self._seen[memo[length]] = _Seen((key, length), self._is_added(piece))
        yield None
        start, chain = 0, None
        for i in range(len(pieces) - 1, -1, -1):
            found = self._chains.get((keys[i], block_size, model))
            if found is not None:
                start, chain = i + 1, found
                break
        if chain is None and text.base is not None:  # the chain at the seen messages' end
            chain = self._chains.get((text.base.key, block_size, model))
        rest = pieces[start:]
        new = [p for p in dict.fromkeys(rest) if p not in self._pieces and not self._is_added(p)]
        yield _Plan(rest, list(keys[start:]), chain, new)

    def _is_added(self, piece: str) -> bool:
        return self._cut is not None and self._cut.fullmatch(piece) is not None

    def _piece_ids(self, plan: _Plan, piece: str) -> array[int]:
        ids = plan.fresh.get(piece) or self._pieces.get(piece)
        if ids is None:
            added = self._added_ids.get(piece)
            if added is not None:  # an added token is one id (the tokenizer splits on it first)
                return array("I", (added,))
            # a piece the LRU dropped meanwhile
            ids = array("I", self.tokenizer.encode(piece, add_special_tokens=False).ids)
        return ids

    def _extend(self, plan: _Plan, model: str, block_size: int) -> Iterator[LocalBlocks | None]:
        """Continue the chain over the plan's pieces; yields None every HASH_STEP_BLOCKS blocks (a point
        where the caller may yield to the loop), then the result."""
        c = plan.chain
        if c is None:
            hashes: list[int] = []
            pending = array("I")
            last, tokens = _seed(model), 0
        else:  # append in place while this chain is the list's end, else branch off a copy
            hashes = c.hashes if len(c.hashes) == c.n else c.hashes[: c.n]
            last, tokens = c.last, c.tokens
            pending = c.pending
        cached = tokens
        step = 4 * block_size  # bytes of a block's ids
        since_yield = 0  # blocks hashed since the last yield
        digests: list[bytes] = []
        for piece, key in zip(plan.pieces, plan.keys, strict=True):
            ids = self._piece_ids(plan, piece)
            run = pending + ids
            full = len(run) // block_size
            data = run[: full * block_size].tobytes()
            at = 0
            while at < len(data):  # up to the next yield, or the piece's last full block
                end = min(len(data), at + (HASH_STEP_BLOCKS - since_yield) * step)
                for i in range(at, end, step):
                    last = blake2b(last + data[i : i + step], digest_size=8).digest()
                    digests.append(last)
                since_yield += (end - at) // step
                at = end
                hashes += _hash_ints(digests)
                digests.clear()
                if since_yield == HASH_STEP_BLOCKS:
                    since_yield = 0
                    yield None  # after an append: a concurrent extend of this chain copies it
            pending = run[full * block_size :]
            tokens += len(ids)
            if key is not None:
                self._chains[(key, block_size, model)] = _Chain(hashes, len(hashes), last, pending, tokens)
        yield LocalBlocks(tuple(hashes), max(1, tokens), cached)


class _Pacer:
    """Yields to the loop once LOOP_SLICE_S has passed since the last yield, the first time once
    FIRST_SLICE_S has passed since it was made."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since = time.perf_counter() + FIRST_SLICE_S - LOOP_SLICE_S

    async def pace(self) -> None:
        if time.perf_counter() - self.since >= LOOP_SLICE_S:
            await asyncio.sleep(0)
            self.since = time.perf_counter()

    async def run(self, steps: Iterator[_T | None]) -> _T:
        """The last value of a stepwise computation, pacing between its steps."""
        out = None
        for out in steps:  # noqa: B007 - the last value is the result
            await self.pace()
        assert out is not None
        return out


@dataclass(slots=True)
class _Plan:
    pieces: list[str]  # pieces after the cached chain, in order
    keys: list[tuple[int, int] | None]  # (hash chain, length) of the text up to the end of each piece
    chain: _Chain | None  # the longest cached chain the text starts with
    new: list[str]  # distinct pieces to encode (in no cache)
    fresh: dict[str, array[int]] = field(default_factory=dict)  # their ids, once encoded


def _last(steps: Iterator[_T | None]) -> _T:
    """The last value of a stepwise computation (`_plan_steps`, `_extend`) run without yielding."""
    out = None
    for out in steps:  # noqa: B007 - the last value is the result
        pass
    assert out is not None
    return out


def reference_hashes(tok: LocalTokenizer, body: Mapping[str, Any], model: str, block_size: int) -> list[int]:
    """Whole-text encode + policy.prefix.token_block_hashes: what the incremental path must equal."""
    text, special = tok.prompt_text(body)
    return list(token_block_hashes(tok.encode(text, special), model=model, block_size=block_size)[0])
