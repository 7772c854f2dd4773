"""Exact prefix mode: a request's prompt token ids, from the model's own workers (`POST /tokenize`).

In exact mode (docs/ROUTING.md "Exact mode") the gateway hashes the prompt's token ids into the same
blocks the agents index from the workers' KV events, so it needs the ids the worker itself will cache.
A model whose `[models."<m>"] tokenizer` names a local model directory is tokenized in the gateway
(plugin/local_tokenizer.py: its tokenizer.json and chat template, no round trip, prefix-incremental);
a request its template cannot render, and every other model, asks a worker. vLLM (and the emulated
worker) serve `POST /tokenize`, which takes
either `{"model", "prompt"}` (completions; special tokens added by default, as `/v1/completions` does)
or `{"model", "messages", ...}` (chat: the worker applies its own chat template, with the chat fields
below passed through so the rendering matches `/v1/chat/completions`), and answers
`{"count", "max_model_len", "tokens": [...]}`.

Cost: one HTTP round trip to a worker per request whose prompt is not in the LRU cache (the gateway
keeps one kept-alive aiohttp session). A call that fails or takes longer than the timeout raises
`TokenizeFailed` with a short reason; the caller then routes that request in approximate mode and
counts the fallback. Completions that already carry token ids need no call.

`tokenize_request` and `response_tokens` are pure; `Tokenizer` is the I/O around them and hashes the
ids into blocks (`policy.prefix.token_block_hashes`, as the agents do).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from cachetools import LRUCache

from plugin.chat_template import TemplateError
from plugin.local_tokenizer import LocalTokenizer
from policy.prefix import chain_namespace, token_block_hashes
from store.registry import WorkerRecord

# Chat fields that change how vLLM renders the prompt (TokenizeChatRequest, ChatCompletionRequest).
CHAT_FIELDS = (
    "tools", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "documents", "mm_processor_kwargs",
)  # fmt: skip
JSON_HEADERS = {"content-type": "application/json"}
FAILED_WORKER_S = 5.0  # a worker whose /tokenize failed is asked last for this long


class TokenizeFailed(Exception):
    """No token ids for this request; `reason` (a metric label) says why."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


TokenizeRequest = dict[str, object] | list[int]  # the /tokenize body, or the token ids the request carries


def tokenize_request(body: Mapping[str, object], model: str) -> TokenizeRequest:
    """The /tokenize body for an OpenAI chat or completions request, or the token ids it already
    carries. Raises TokenizeFailed("unsupported") for prompts /tokenize cannot take (batches)."""
    if "messages" in body:
        return chat_tokenize_request(body, model)
    return completion_tokenize_request(body, model)


def chat_tokenize_request(body: Mapping[str, object], model: str) -> TokenizeRequest:
    """A chat request's /tokenize body: the worker applies its own chat template."""
    out: dict[str, object] = {"model": model, "messages": body["messages"]}
    out.update((k, body[k]) for k in CHAT_FIELDS if k in body)
    return out


def completion_tokenize_request(body: Mapping[str, object], model: str) -> TokenizeRequest:
    """A completions request's /tokenize body, or its own token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        out: dict[str, object] = {"model": model, "prompt": prompt}
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return [t for t in prompt if isinstance(t, int)]
    raise TokenizeFailed("unsupported", "prompt batches are routed in approximate mode")


def response_tokens(data: object) -> list[int]:
    """The token ids of a /tokenize answer; TokenizeFailed("bad_response") if it has none."""
    tokens = data.get("tokens") if isinstance(data, Mapping) else None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise TokenizeFailed("bad_response", "no integer list 'tokens' in the /tokenize answer")
    return tokens


@dataclass(frozen=True, slots=True)
class TokenBlocks:
    """A prompt's token-block hashes (policy.prefix.token_block_hashes) and its token count."""

    hashes: tuple[int, ...]
    block_tokens: tuple[int, ...]
    prompt_tokens: int


class Tokenizer:
    """Token-block hashes of prompts from the pool's workers' token ids, with an LRU of recent prompts
    (their hashes, so a repeated prompt costs neither a call nor decoding and hashing); one kept-alive
    session."""

    def __init__(
        self, *, timeout_s: float, cache_entries: int, local: Mapping[str, LocalTokenizer] | None = None
    ) -> None:
        self.local = dict(local or {})  # model -> its own tokenizer and chat template (no round trip)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.cache: LRUCache[tuple[str, int, str], TokenBlocks] | None = (
            LRUCache(maxsize=cache_entries) if cache_entries > 0 else None
        )
        self._session: aiohttp.ClientSession | None = None
        self._turn = itertools.count()
        self._failed: dict[str, float] = {}  # worker id -> monotonic time of its last failure

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def blocks(
        self,
        body: Mapping[str, object],
        model: str,
        workers: Sequence[WorkerRecord],
        block_size: int,
        request_for: Callable[[Mapping[str, object], str], TokenizeRequest] = tokenize_request,
    ) -> tuple[TokenBlocks, str]:
        """(blocks, source) with source "prompt" (ids in the request), "local" (the model's own
        tokenizer, plugin/local_tokenizer.py), "cache" or "worker"; `request_for` is the endpoint's
        /tokenize body (plugin/endpoints.py). The chain is seeded by `request_namespace` (the model and
        the request's `cache_salt`, as the engine's keys are). Raises TokenizeFailed."""
        request = request_for(body, model)
        chain = request_namespace(body, model)
        if isinstance(request, list):
            return _hashed(request, chain, block_size), "prompt"
        local = self.local.get(model)
        if local is not None:
            try:
                mine = await local.blocks_async(body, chain, block_size)
            except TemplateError:
                pass  # a request the local template cannot render (e.g. images): the worker renders it
            else:
                sizes = (block_size,) * len(mine.hashes)
                return TokenBlocks(mine.hashes, sizes, mine.prompt_tokens), "local"
        key = json.dumps(request, separators=(",", ":"))  # the cache key is also the body sent
        if self.cache is not None and (hit := self.cache.get((key, block_size, chain))) is not None:
            return hit, "cache"
        worker = self._pick(workers)
        found = _hashed(await self._ask(worker, key), chain, block_size)
        self._failed.pop(worker.id, None)
        if self.cache is not None:
            self.cache[(key, block_size, chain)] = found
        return found, "worker"

    def _pick(self, workers: Sequence[WorkerRecord]) -> WorkerRecord:
        """Round robin over the routable workers, those that failed recently last."""
        if not workers:
            raise TokenizeFailed("no_worker")
        now = time.monotonic()
        start = next(self._turn)
        order = [workers[(start + i) % len(workers)] for i in range(len(workers))]
        return min(order, key=lambda w: now - self._failed.get(w.id, -FAILED_WORKER_S) < FAILED_WORKER_S)

    async def _ask(self, worker: WorkerRecord, body: str) -> list[int]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            )
        base = worker.url if "://" in worker.url else f"http://{worker.url}"
        url = base.rstrip("/") + "/tokenize"
        try:
            async with self._session.post(url, data=body, headers=JSON_HEADERS) as resp:
                if resp.status != 200:
                    raise TokenizeFailed("error", f"{worker.id} answered {resp.status}")
                return response_tokens(await resp.json(content_type=None))
        except TimeoutError:
            self._failed[worker.id] = time.monotonic()
            raise TokenizeFailed("timeout", worker.id) from None
        except (aiohttp.ClientError, OSError, ValueError) as e:
            self._failed[worker.id] = time.monotonic()
            raise TokenizeFailed("error", f"{worker.id}: {e}") from None
        except TokenizeFailed:
            self._failed[worker.id] = time.monotonic()
            raise


def request_namespace(body: Mapping[str, object], model: str) -> str:
    """The exact-mode chain name of a request: its model (a LoRA adapter is served under its own name)
    and vLLM's `cache_salt`, which the engine mixes into block 0 (policy.prefix.chain_namespace)."""
    salt = body.get("cache_salt")
    return chain_namespace(model, (salt,) if isinstance(salt, str) and salt else ())


def _hashed(ids: Sequence[int], model: str, block_size: int) -> TokenBlocks:
    try:
        hashes, tokens = token_block_hashes(ids, model=model, block_size=block_size)
    except OverflowError:  # a negative or > 32-bit id
        raise TokenizeFailed("bad_response", "token id out of range") from None
    return TokenBlocks(hashes, tokens, max(1, len(ids)))
