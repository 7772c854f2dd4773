"""The emulated worker's fake tokenizer, chat template and prefix-cache block keys.

Deterministic across processes and machines (no Python `hash()`), so every emulated worker and
every test agrees on token ids and block keys, as real vLLM workers sharing a tokenizer and a
`PYTHONHASHSEED` do.

- Tokens: the text is cut into fixed 4-character pieces from its start; a piece's id is
  blake2b(piece) mod `VOCAB_SIZE`. Equal leading text therefore gives equal leading tokens, and a
  prompt of n characters has ceil(n / 4) tokens (roughly the ratio of real BPE tokenizers on English).
- Chat template (Llama-3 style, `add_generation_prompt=True`):
      <|begin_of_text|>
      <|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>     (one per message)
      <|start_header_id|>assistant<|end_header_id|>\\n\\n
  so an identical system prompt and history render to an identical leading string.
- Block keys: vLLM caches full blocks only; key[i] = blake2b(key[i-1] ‖ tokens of block i) as a
  64-bit int, key[-1] = `ROOT_KEY`. These keys are also the block hashes published in KV events.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from policy.prefix import CHARS_PER_TOKEN  # the one estimate (PEERS §5: 4 characters per token)

VOCAB_SIZE = 128_256  # Llama-3's vocabulary size
ROOT_KEY = int.from_bytes(hashlib.blake2b(b"kvgate-emulator-root", digest_size=8).digest(), "big")
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

BEGIN = "<|begin_of_text|>"
HEADER_START = "<|start_header_id|>"
HEADER_END = "<|end_header_id|>\n\n"
END_OF_TURN = "<|eot_id|>"


_PIECE_IDS: dict[str, int] = {}  # memo: real text repeats pieces, and hashing each is the slow part
_MAX_MEMO = 1 << 20


def _piece_id(piece: str) -> int:
    digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=4).digest()
    return int.from_bytes(digest, "big") % VOCAB_SIZE


def tokenize(text: str) -> list[int]:
    """Token ids of `text`: one per 4-character piece, in order."""
    pieces = [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]
    missing = set(pieces).difference(_PIECE_IDS)
    if len(_PIECE_IDS) + len(missing) > _MAX_MEMO:
        _PIECE_IDS.clear()
        missing = set(pieces)
    for piece in missing:
        _PIECE_IDS[piece] = _piece_id(piece)
    return list(map(_PIECE_IDS.__getitem__, pieces))


def count_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


class TemplateError(ValueError):
    """A `messages` list the chat template cannot render; the message is client-facing."""


def message_text(content: Any, where: str) -> str:
    """A message's `content`: a string, or a list of `{"type": "text", "text": ...}` parts (OpenAI)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise TemplateError(f"{where}.content[{i}]: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise TemplateError(f"{where}.content: must be a string or a list of text parts")


def render_chat(messages: Any) -> str:
    """The prompt string of an OpenAI `messages` list (see the module docstring for the template)."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages: must be a non-empty list")
    out = [BEGIN]
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TemplateError(f"{where}: must be an object")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise TemplateError(f"{where}.role: must be one of {sorted(CHAT_ROLES)}, not {role!r}")
        out += [HEADER_START, role, HEADER_END, message_text(message.get("content"), where), END_OF_TURN]
    out += [HEADER_START, "assistant", HEADER_END]
    return "".join(out)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    ids = array("I", tokens)
    if sys.byteorder == "big":  # hash the same bytes on every machine
        ids.byteswap()
    return ids.tobytes()


def block_key(parent: int, block_tokens: Sequence[int]) -> int:
    """The cache key of one full block after the block keyed `parent`: blake2b-64(parent ‖ u32 LE tokens)."""
    payload = parent.to_bytes(8, "big") + _token_bytes(block_tokens)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "big")


def root_key(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The parent of block 0: ROOT_KEY, or one of its own per LoRA adapter and cache salt."""
    if lora_name is None and cache_salt is None:
        return ROOT_KEY
    extra = f"{lora_name}\x00{cache_salt}".encode()
    return int.from_bytes(hashlib.blake2b(ROOT_KEY.to_bytes(8, "big") + extra, digest_size=8).digest(), "big")


def full_block_keys(tokens: Sequence[int], block_size: int, root: int = ROOT_KEY) -> list[int]:
    """Chained keys of the full blocks of `tokens` (a trailing partial block has none); as `block_key`."""
    data = _token_bytes(tokens)
    stride = 4 * block_size
    parent = root.to_bytes(8, "big")
    digests = []
    for start in range(0, (len(tokens) // block_size) * stride, stride):
        parent = hashlib.blake2b(parent + data[start : start + stride], digest_size=8).digest()
        digests.append(parent)
    return [int.from_bytes(d, "big") for d in digests]
