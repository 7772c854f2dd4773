"""Prefix hashing shared by the gateway and the simulator: request → chained block hashes.

Two modes (DESIGN.md, "Two prefix-index modes"):
  approximate  `canonical_text(body)` renders an OpenAI request so that the same tools + system prompt +
               history give the same leading characters; `text_block_hashes` cuts it into fixed chunks of
               `chunk_chars` characters (tail chunk included) and chains a 64-bit hash over them.
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
from collections.abc import Mapping, Sequence
from hashlib import blake2b

CHARS_PER_TOKEN = 4  # rough estimate for English text; only used to weigh approximate blocks
DEFAULT_CHUNK_CHARS = 256  # 64 tokens per approximate block
DEFAULT_MAX_BLOCKS = 512  # 128k characters ≈ 32k tokens; later text does not change routing
# the chat roles an OpenAI request may carry (the gateway refuses others: plugin/endpoints.py)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _seed(model: str) -> bytes:
    return blake2b(b"kvgate\x00" + model.encode(), digest_size=8).digest()


def chain_namespace(model: str, salt: Sequence[object] = ()) -> str:
    """The name an exact-mode chain is seeded with: `model` (or the LoRA adapter's name), plus block 0's
    extra keys other than the adapter's name (vLLM: `cache_salt`; multimodal hashes, which the gateway
    never computes, give a namespace it never matches) when there are any."""
    return model if not salt else f"{model}\x00{_json(list(salt))}"


def chain_seed(name: str) -> int:
    """The chain state before block 0 of `name`'s chain, as the int a chain continues from (LE)."""
    return int.from_bytes(_seed(name), "little")


def _json(value: object) -> str:
    """Key-order- and whitespace-independent JSON, the canonical form of structured fields."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string, a list of content parts or null")
    out: list[str] = []
    for i, part in enumerate(content):
        if isinstance(part, str):  # lenient: some clients send bare strings in the list
            out.append(part)
            continue
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise ValueError(f"{where}.content[{i}] must be an object with a string 'type'")
        kind = part["type"]
        if kind in ("text", "input_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{i}].text must be a string")
            out.append(text)
        elif kind == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, Mapping) else ref
            if not isinstance(url, str):
                raise ValueError(f"{where}.content[{i}].image_url.url must be a string")
            out.append(f"<image:{url}>")
        else:  # input_audio, file, ...: canonical JSON stands for the part
            out.append(f"<{kind}:{_json(part)}>")
    return "".join(out)


def _message_text(msg: object, where: str) -> str:
    if not isinstance(msg, Mapping):
        raise ValueError(f"{where} must be an object")
    role = msg.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"{where}.role must be one of {sorted(ROLES)}, not {role!r}")
    head = f"<|{role}"
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ValueError(f"{where}.name must be a string")
        head += f" name={name}"
    call_id = msg.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise ValueError(f"{where}.tool_call_id must be a string")
        head += f" call={call_id}"
    text = _content_text(msg.get("content"), where)
    calls = msg.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ValueError(f"{where}.tool_calls[{j}].function.name must be a string")
            args = fn.get("arguments", "")
            args_text = args if isinstance(args, str) else _json(args)
            text += f"<call {call.get('id', '')} {fn['name']}>{args_text}"
    reasoning = msg.get("reasoning_content")
    if isinstance(reasoning, str):
        text = f"<think>{reasoning}</think>" + text
    return f"{head}|>{text}\n"


def canonical_text(body: Mapping[str, object]) -> str:
    """Canonical rendering of an OpenAI chat or completions request body for approximate prefix hashing:
    `chat_text` when it has `messages`, else `completion_text`. Raises ValueError naming the offending
    field when the body is not a valid request."""
    if not isinstance(body, Mapping):
        raise ValueError("request body must be a JSON object")
    if "messages" in body:
        return chat_text(body)
    if "prompt" in body:
        return completion_text(body)
    raise ValueError("request has neither 'messages' (chat) nor 'prompt' (completions)")


def chat_text(body: Mapping[str, object]) -> str:
    """A chat request: `tools` (canonical JSON, first: they act like a system prompt), then each message
    as `<|role name=.. call=..|>content<call id fn>args\n`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    parts: list[str] = []
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("tools must be a list")
        parts.append(f"<|tools|>{_json(tools)}\n")
    parts.extend(_message_text(m, f"messages[{i}]") for i, m in enumerate(messages))
    return "".join(parts)


def completion_text(body: Mapping[str, object]) -> str:
    """A completions request: `prompt` as text, token ids as `<tokens:1,2,3>`."""
    return _prompt_text(body.get("prompt"))


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_text(prompt: object) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if _is_token_list(prompt):
            return "<tokens:" + ",".join(map(str, prompt)) + ">"
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(p for p in prompt if isinstance(p, str))
        if all(_is_token_list(p) for p in prompt):
            return "\n".join("<tokens:" + ",".join(map(str, p)) + ">" for p in prompt if isinstance(p, list))
    raise ValueError("prompt must be a string, a list of strings or token ids, or a list of token-id lists")


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
