"""The state of one emulated vLLM worker (config, engine driver, counters) and the HTTP helpers its
handlers share. bench/emulator/server.py assembles the app; completions.py and endpoints.py hold handlers.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bench.emulator.driver import EngineDriver
from bench.emulator.engine_tokenizer import EngineTokenizer, FakeTokenizer
from bench.emulator.kv_events import BlockCatalog, KvEventPublisher
from bench.emulator.metrics import EngineSnapshot, RequestMetrics
from bench.emulator.openai_api import ApiError
from bench.emulator.tokenizer import full_block_keys, root_key
from bench.sim.profiles import EngineProfile, load_profile, scaled

logger = logging.getLogger(__name__)


MAX_BODY_BYTES = 64 * 1024 * 1024  # a 128k-token prompt is ~0.5 MB of text; leave room for JSON


@dataclass(frozen=True)
class EmulatorConfig:
    model: str = "emulated-model"
    # more names served for the same engine (vLLM --served-model-name)
    extra_model_names: tuple[str, ...] = ()
    profile: str = "h100-llama3.1-8b"
    num_gpu_blocks: int | None = None  # override the profile's KV pool (smaller pools show cache pressure)
    time_scale: float = 1.0  # wall seconds per virtual second: 0.1 runs 10x faster than the modelled GPU
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = "emulator"
    kv_events_endpoint: str | None = None  # e.g. tcp://127.0.0.1:5557 (bound); None = no KV events
    kv_events_topic: str | None = None  # default kv@<worker_id>@<model>
    # vLLM's KVEventsConfig.replay_endpoint: a ROUTER socket serving buffered batches (None = no replay)
    kv_events_replay_endpoint: str | None = None
    # served names that are LoRA adapters of the model (vLLM --lora-modules): their blocks get other keys
    lora_adapters: tuple[str, ...] = ()
    default_max_tokens: int = 64  # output length when a request gives no max_tokens
    max_model_len: int = 131_072
    stream_interval_s: float = 0.02  # decoding streams flush new tokens at most this often (wall)
    # a model directory (tokenizer.json + tokenizer_config.json) to tokenize and render chats with, as
    # vLLM does through transformers; None = the fake tokenizer (bench/emulator/engine_tokenizer.py)
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be > 0, got {self.num_gpu_blocks}")
        if self.default_max_tokens <= 0 or self.max_model_len <= 0:
            raise ValueError("default_max_tokens and max_model_len must be > 0")
        if self.stream_interval_s <= 0:
            raise ValueError(f"stream_interval_s must be > 0, got {self.stream_interval_s}")

    def effective_max_model_len(self, profile: EngineProfile) -> int:
        """vLLM refuses to start when one max-length request cannot fit its KV pool; the emulator, whose
        pool is often shrunk on purpose (`num_gpu_blocks`), lowers max_model_len to the pool instead."""
        return min(self.max_model_len, profile.capacity_tokens)

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model, *self.extra_model_names, *self.lora_adapters)

    def engine_profile(self) -> EngineProfile:
        profile = load_profile(self.profile)
        if self.num_gpu_blocks is not None:
            profile = scaled(profile, num_gpu_blocks=self.num_gpu_blocks)
        return profile


HELD_LOG_MAX = 200_000


@dataclass
class Worker:
    """Everything one server holds: the engine driver and what the HTTP layer counts."""

    config: EmulatorConfig
    profile: EngineProfile
    driver: EngineDriver
    metrics: RequestMetrics
    catalog: BlockCatalog | None  # only with KV events
    publisher: KvEventPublisher | None
    held: Counter[str]  # external request ids of the completion requests in flight
    rng: random.Random
    max_model_len: int  # the config's, capped to the KV pool
    tokenizer: EngineTokenizer = field(default_factory=FakeTokenizer)
    # (CLOCK_MONOTONIC s, +1 started / -1 ended, external id) of every completion request, for an
    # exact count of what ran at once across workers (kvgate bench chaos); bounded
    held_log: deque[tuple[float, int, str]] = field(default_factory=lambda: deque(maxlen=HELD_LOG_MAX))
    held_log_total: int = 0  # entries ever appended (the cursor of GET /kvgate/held_log)

    def log_held(self, delta: int, external_id: str) -> None:
        self.held_log.append((time.monotonic(), delta, external_id))
        self.held_log_total += 1

    def lora_of(self, model: str) -> str | None:
        return model if model in self.config.lora_adapters else None

    def engine_blocks(
        self, tokens: list[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> list[tuple[int, int]]:
        """(key, tokens) per engine block: full blocks by chained key (an adapter's or a salted request's
        chain starts elsewhere, as vLLM's extra keys make it); the trailing partial block gets a key no
        other request uses, so it is never a cache hit (vLLM caches full blocks only)."""
        size = self.profile.block_size
        keys = full_block_keys(tokens, size, root_key(lora_name, cache_salt))
        if self.catalog is not None:
            self.catalog.remember(keys, tokens, size, lora_name, cache_salt)
        blocks = [(key, size) for key in keys]
        if rest := len(tokens) - len(keys) * size:
            blocks.append((self.rng.getrandbits(64), rest))
        return blocks

    def snapshot(self) -> EngineSnapshot:
        engine = self.driver.engine
        return EngineSnapshot(
            running=engine.running,
            waiting=engine.waiting,
            kv_usage=float(engine.kv_usage),
            prefix_cache_queries=int(engine.prefix_cache_queries),
            prefix_cache_hits=int(engine.prefix_cache_hits),
            num_preemptions=int(engine.num_preemptions),
            block_size=self.profile.block_size,
            num_gpu_blocks=self.profile.num_gpu_blocks,
        )


WORKER_CONFIG = web.AppKey("worker_config", EmulatorConfig)
WORKER = web.AppKey("worker", Worker)


ENGINE_FAILED = ApiError(500, "the emulated engine failed; see the worker's log")


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


async def read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"Invalid JSON body: {e}") from None
