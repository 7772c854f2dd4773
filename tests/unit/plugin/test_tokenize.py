"""Exact prefix mode: /tokenize bodies, answers, the tokenizer client and the router's exact prompt.

The worker is the real emulated vLLM worker (bench/emulator) on a free loopback port; failures use a
closed port and a small aiohttp server that answers what the test asks for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from bench.emulator.tokenizer import render_chat, tokenize
from plugin.config import RoutingSection
from plugin.flow import Prompt, Route
from plugin.metrics import GatewayMetrics
from plugin.prefix_memo import hash_prompt
from plugin.routing import Router
from plugin.tokenize import TokenizeFailed, Tokenizer, response_tokens, tokenize_request
from policy.prefix import token_block_hashes
from policy.types import Band
from store import index_store
from store.redis_server import free_port
from store.registry import WorkerRecord
from tests.e2e.harness import start_worker

MODEL = "m"
MESSAGES = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hi"}]


def record(wid: str, url: str, **kw: object) -> WorkerRecord:
    return WorkerRecord(id=wid, model=MODEL, url=url, lease_expiry_ms=2**62, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}], "temperature": 0.2,
             "add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}},
            {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}],
             "add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}},
            id="chat: template fields pass through, sampling fields do not",
        ),
        pytest.param({"model": MODEL, "prompt": "ab"}, {"model": MODEL, "prompt": "ab"}, id="text"),
        pytest.param(
            {"model": MODEL, "prompt": ["abc"], "add_special_tokens": False},
            {"model": MODEL, "prompt": "abc", "add_special_tokens": False},
            id="batch of one string, special tokens as asked",
        ),
        pytest.param({"model": MODEL, "prompt": [5, 6, 7]}, [5, 6, 7], id="token ids need no call"),
        pytest.param({"model": MODEL, "prompt": [[5, 6]]}, [5, 6], id="batch of one token list"),
    ],
)  # fmt: skip
def test_tokenize_request(body: dict[str, object], expected: object) -> None:
    assert tokenize_request(body, MODEL) == expected


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"prompt": ["a", "b"]}, id="two prompts"),
        pytest.param({"prompt": [[1], [2]]}, id="two token lists"),
    ],
)
def test_batches_are_unsupported(body: dict[str, object]) -> None:
    with pytest.raises(TokenizeFailed) as info:
        tokenize_request(body, MODEL)
    assert info.value.reason == "unsupported"


@pytest.mark.parametrize(
    "data",
    [
        pytest.param({"count": 2}, id="no tokens"),
        pytest.param({"tokens": [1, "2"]}, id="a string id"),
        pytest.param({"tokens": [1, True]}, id="a bool id"),
        pytest.param([1, 2], id="not an object"),
    ],
)
def test_bad_answers(data: object) -> None:
    with pytest.raises(TokenizeFailed) as info:
        response_tokens(data)
    assert info.value.reason == "bad_response"


@pytest.fixture
async def emulated() -> AsyncIterator[WorkerRecord]:
    runner, url = await start_worker(MODEL, "w0", time_scale=0.05)
    try:
        yield record("w0", url)
    finally:
        await runner.cleanup()


@pytest.fixture
async def stub() -> AsyncIterator[tuple[WorkerRecord, asyncio.Event]]:
    """A worker whose /tokenize answers 503 until `ready` is set, then hangs (for timeouts)."""
    ready = asyncio.Event()
    release = asyncio.Event()

    async def tokenize_handler(_: web.Request) -> web.Response:
        if not ready.is_set():
            return web.json_response({"error": "busy"}, status=503)
        await release.wait()
        return web.json_response({"tokens": [1]})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield record("stub", f"127.0.0.1:{port}"), ready
    finally:
        release.set()
        await runner.cleanup()


async def test_chat_blocks_are_the_workers_own_then_cached(emulated: WorkerRecord) -> None:
    tokenizer = Tokenizer(timeout_s=5, cache_entries=8)
    try:
        body = {"model": MODEL, "messages": MESSAGES}
        ids = tokenize(render_chat(MESSAGES))
        found, source = await tokenizer.blocks(body, MODEL, [emulated], 16)
        assert source == "worker" and found.prompt_tokens == len(ids)
        assert found.hashes == token_block_hashes(ids, model=MODEL, block_size=16)[0]
        assert await tokenizer.blocks(body, MODEL, [emulated], 16) == (found, "cache")
        other_size, source = await tokenizer.blocks(body, MODEL, [emulated], 32)
        assert source == "worker" and len(other_size.hashes) == len(ids) // 32
        found, source = await tokenizer.blocks({"prompt": [3, 4] * 8}, MODEL, [emulated], 16)
        assert (len(found.hashes), found.prompt_tokens, source) == (1, 16, "prompt")
        with pytest.raises(TokenizeFailed, match="out of range"):
            await tokenizer.blocks({"prompt": [-1]}, MODEL, [emulated], 16)
    finally:
        await tokenizer.close()


async def test_failures_name_their_reason(stub: tuple[WorkerRecord, asyncio.Event]) -> None:
    worker, ready = stub
    dead = record("dead", f"http://127.0.0.1:{free_port()}")
    tokenizer = Tokenizer(timeout_s=1.0, cache_entries=0)
    body = {"model": MODEL, "prompt": "text"}
    try:
        for workers, reason in [([], "no_worker"), ([dead], "error"), ([worker], "error")]:
            with pytest.raises(TokenizeFailed) as info:
                await tokenizer.blocks(body, MODEL, workers, 16)
            assert info.value.reason == reason
        ready.set()  # the stub now never answers
        with pytest.raises(TokenizeFailed) as info:
            await tokenizer.blocks(body, MODEL, [worker], 16)
        assert info.value.reason == "timeout"
    finally:
        await tokenizer.close()


async def test_a_failed_worker_is_asked_last(emulated: WorkerRecord) -> None:
    dead = record("dead", f"http://127.0.0.1:{free_port()}")
    tokenizer = Tokenizer(timeout_s=2, cache_entries=0)
    try:
        outcomes = []
        for i in range(4):
            try:
                await tokenizer.blocks({"prompt": f"p{i}"}, MODEL, [dead, emulated], 16)
                outcomes.append("ok")
            except TokenizeFailed as e:
                outcomes.append(e.reason)
        assert outcomes.count("error") <= 1 and outcomes[-3:] == ["ok"] * 3, outcomes
    finally:
        await tokenizer.close()


async def test_router_routes_exact_prompts_on_the_agents_entries(emulated: WorkerRecord) -> None:
    """Token-block hashes from the worker's ids match what an agent indexes from KV events."""
    metrics = GatewayMetrics()
    router = Router(RoutingSection(prefix_mode="exact", exact_speculative=False), metrics=metrics)
    holder = record("w1", emulated.url, router_block_size=16, capacity_tokens=100_000)
    workers = [record("w0", emulated.url, router_block_size=16, capacity_tokens=100_000), holder]
    body = {"model": MODEL, "messages": MESSAGES}
    try:
        fallback = hash_prompt(body, MODEL, 512)
        computed: list[int] = []  # the text-chunk hashes are computed only when there are no token ids

        def lazy() -> Prompt:
            computed.append(1)
            return fallback

        prompt = await router.exact_prompt(body, MODEL, lazy, workers)
        assert computed == []
        ids = tokenize(render_chat(MESSAGES))
        assert prompt.exact and prompt.prompt_tokens == len(ids)
        agent_keys = token_block_hashes(ids, model=MODEL, block_size=16)[0]  # what the agent writes
        assert prompt.hashes == agent_keys and len(prompt.hashes) == len(ids) // 16
        router.apply_index_ops(MODEL, [index_store.IndexOp("add", "w1", tuple(reversed(agent_keys)))])
        for i in range(3):
            route = router.route(request_id=f"r{i}", model=MODEL, prompt=prompt, max_tokens=8,
                                 band=Band.NORMAL, tenant="t", workers=workers)  # fmt: skip
            assert route is not None and route.worker.id == "w1"
            router.finished(route)
        router.apply_index_ops(MODEL, [index_store.IndexOp("clear", "w1")])
        assert router.best_hit_tokens(MODEL, prompt) == 0
        assert metrics.tokenized.get(MODEL, "worker") == 1
        dead = [record("dead", f"http://127.0.0.1:{free_port()}")]
        other = {"model": MODEL, "messages": [{"role": "user", "content": "not cached"}]}
        assert await router.exact_prompt(other, MODEL, fallback, dead) is fallback
        assert await router.exact_prompt(other, MODEL, lazy, dead) is fallback and computed == [1]
        assert metrics.prefix_fallbacks.get(MODEL, "error") == 2
    finally:
        await router.close()


@pytest.mark.parametrize(
    ("speculative", "entries"),
    [
        pytest.param(True, 4, id="speculative: routed blocks enter the mirror"),
        pytest.param(False, 0, id="not"),
    ],
)
async def test_speculative_entries(speculative: bool, entries: int, redis: aioredis.Redis) -> None:
    router = Router(RoutingSection(prefix_mode="exact", exact_speculative=speculative), redis)
    hashes, tokens = token_block_hashes(list(range(64)), model=MODEL, block_size=16)
    prompt = Prompt(hashes, tokens, 64, exact=True)
    workers = [record("w0", "http://x", capacity_tokens=10_000, router_block_size=16)]  # KV events
    route = router.route(request_id="r", model=MODEL, prompt=prompt, max_tokens=8, band=Band.NORMAL,
                         tenant="t", workers=workers)  # fmt: skip
    assert route is not None and router.model(MODEL).state.index.size("w0") == entries
    assert router.model(MODEL).state.index.speculative_size("w0") == entries
    assert not router._pending_index  # a worker with KV events: nothing written to the shared index


async def test_a_worker_without_kv_events_gets_routing_history_in_exact_mode(redis: aioredis.Redis) -> None:
    """Hybrid index: in an exact-mode pool a worker whose agent publishes no events is indexed from
    routing history (token-block hashes, written to Redis as approximate mode does); the route says
    which kind of entry its match rested on."""
    router = Router(RoutingSection(prefix_mode="exact"), redis)
    hashes, tokens = token_block_hashes(list(range(64)), model=MODEL, block_size=16)
    prompt = Prompt(hashes, tokens, 64, exact=True)
    plain = record("p0", "http://x", capacity_tokens=10_000)  # no router block size: no KV events

    def route_once(i: int) -> Route:
        route = router.route(request_id=f"r{i}", model=MODEL, prompt=prompt, max_tokens=8,
                             band=Band.NORMAL, tenant="t", workers=[plain])  # fmt: skip
        assert route is not None
        router.finished(route)
        return route

    assert route_once(0).index_kind == "none"
    assert router._pending_index[(MODEL, "p0")][1] == list(hashes)
    assert route_once(1).index_kind == "approximate"
    assert router.model(MODEL).state.index.speculative_size("p0") == 0


@pytest.mark.parametrize(
    ("configured", "registered", "expected"),
    [
        pytest.param(0, [32, 32, 16], 32, id="most agents' size"),
        pytest.param(0, [0, 0], 16, id="no agent size: 16"),
        pytest.param(64, [32], 64, id="config wins"),
    ],
)
def test_block_size(configured: int, registered: list[int], expected: int) -> None:
    router = Router(RoutingSection(prefix_mode="exact", exact_block_size=configured))
    workers = [record(f"w{i}", "http://x", router_block_size=b) for i, b in enumerate(registered)]
    assert router.block_size(MODEL, workers) == expected
    assert router.model(MODEL).blocks_per_token == 1 / expected


async def test_a_prefix_shorter_than_the_threshold_writes_no_index_entry(redis: aioredis.Redis) -> None:
    router = Router(RoutingSection(prefix_mode="exact", index_min_prefix_tokens=64), redis)
    plain = record("p0", "http://x", capacity_tokens=10_000)
    for tokens, written in ((48, False), (64, True)):
        hashes, block_tokens = token_block_hashes(list(range(tokens)), model=MODEL, block_size=16)
        prompt = Prompt(hashes, block_tokens, tokens, exact=True)
        route = router.route(request_id=f"r{tokens}", model=MODEL, prompt=prompt, max_tokens=8,
                             band=Band.NORMAL, tenant="t", workers=[plain])  # fmt: skip
        assert route is not None
        assert ((MODEL, "p0") in router._pending_index) is written
        assert (router.model(MODEL).state.index.size("p0") > 0) is written
