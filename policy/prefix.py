"""Prefix hashing shared by the gateway and the simulator: request → chained block hashes.

Two modes (DESIGN.md, "Two prefix-index modes"):
  approximate  `canonical_text(body)` (policy/request.py) renders an OpenAI request so that the same
               tools + system prompt + history give the same leading characters; `text_block_hashes`
               cuts it into fixed chunks of `chunk_chars` characters (tail chunk included) and
               chains a 64-bit hash over them.
  exact        `token_block_hashes` chains a hash over full blocks of `block_size` token ids (the engine
               caches only full blocks, so the tail is left out).

Hash i covers everything up to and including block i (hash_i = H(hash_{i-1} ‖ block_i)), so equal hashes at
position i mean equal prefixes — the Mooncake `hash_ids` semantics. The chain is seeded by the model name:
two models never share cache entries. In exact mode the seed is `chain_namespace(model, salt)`: the model
or LoRA adapter name (vLLM serves an adapter under its own name) and the engine's extra keys of block 0
(vLLM's `cache_salt`), as vLLM's block hashes include them, so two adapters' or salts' identical prompts
never share keys. blake2b (stdlib, digest 8 bytes) is fast enough: a 16k-character
prompt hashes in ~0.03 ms (see docs/ROUTING.md).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from hashlib import blake2b

CHARS_PER_TOKEN = 4  # rough estimate for English text; only used to weigh approximate blocks
DEFAULT_CHUNK_CHARS = 256  # 64 tokens per approximate block
DEFAULT_MAX_BLOCKS = 512  # 128k characters ≈ 32k tokens; later text does not change routing


def _seed(model: str) -> bytes:
    return blake2b(b"kvgate\x00" + model.encode(), digest_size=8).digest()


def chain_namespace(model: str, salt: Sequence[object] = ()) -> str:
    """The name an exact-mode chain is seeded with: `model` (or the LoRA adapter's name), plus block 0's
    extra keys other than the adapter's name (vLLM: `cache_salt`; multimodal hashes, which the gateway
    never computes, give a namespace it never matches) when there are any."""
    return model if not salt else f"{model}\x00{canonical_json(list(salt))}"


def chain_seed(name: str) -> int:
    """The chain state before block 0 of `name`'s chain, as the int a chain continues from (LE)."""
    return int.from_bytes(_seed(name), "little")


def canonical_json(value: object) -> str:
    """Key-order- and whitespace-independent JSON, the canonical form of structured fields."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def text_block_hashes(
    text: str,
    *,
    model: str,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chained hashes over `chunk_chars`-character chunks of `text` (tail chunk included, at most
    `max_blocks` chunks) and each chunk's estimated tokens (ceil(chars / 4))."""
    if chunk_chars <= 0 or max_blocks <= 0:
        raise ValueError("chunk_chars and max_blocks must be > 0")
    prev = _seed(model)
    hashes: list[int] = []
    end = min(len(text), chunk_chars * max_blocks)
    if text.isascii():  # common case: one encode, byte offsets equal character offsets
        data = text[:end].encode()
        chunks: Sequence[bytes] = [data[s : s + chunk_chars] for s in range(0, end, chunk_chars)]
    else:
        chunks = [text[s : min(s + chunk_chars, end)].encode() for s in range(0, end, chunk_chars)]
    for chunk in chunks:
        prev = blake2b(prev + chunk, digest_size=8).digest()
        hashes.append(int.from_bytes(prev, "little"))
    return tuple(hashes), chunk_tokens(len(hashes), end, chunk_chars)


def chunk_tokens(chunks: int, end: int, chunk_chars: int) -> tuple[int, ...]:
    """Estimated tokens of each of `chunks` text chunks covering `end` characters: ceil(chars / 4)."""
    tokens = [-(-chunk_chars // CHARS_PER_TOKEN)] * chunks
    if chunks and end % chunk_chars:
        tokens[-1] = -(-(end % chunk_chars) // CHARS_PER_TOKEN)
    return tuple(tokens)


def token_block_hashes(
    token_ids: Sequence[int], *, model: str, block_size: int = 16
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chained hashes over full blocks of `block_size` token ids (little-endian u32), and the block sizes."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    prev = _seed(model)
    packed = array("I", token_ids).tobytes()  # 4 bytes per token id; raises OverflowError on bad ids
    step = 4 * block_size
    full = len(token_ids) // block_size
    hashes: list[int] = []
    for i in range(full):
        prev = blake2b(prev + packed[i * step : (i + 1) * step], digest_size=8).digest()
        hashes.append(int.from_bytes(prev, "little"))
    return tuple(hashes), (block_size,) * full
