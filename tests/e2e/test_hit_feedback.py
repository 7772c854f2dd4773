"""Hit feedback end to end (`routing.hit_feedback`, policy/feedback.py): a worker's cache reset is unlearnt
from the next response's `usage.prompt_tokens_details.cached_tokens`, in Redis, where every gateway sees it.

One emulated worker without KV events (the approximate index: routing history), one `kvgate proxy`.
Two prefixes are routed to it and indexed; the worker's prefix cache is reset (as a restart would);
the next request on the newer prefix expects a long hit and the worker reports none. Every entry used
before the newer prefix's root was last used (the older prefix, and the first request's own last
block) must leave the shared index; the reporting request's blocks (its prefill cached them again)
must stay.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from plugin.prefix_memo import hash_prompt
from plugin.static_workers import static_worker_id
from store import index_store
from tests.e2e.harness import Gateway, chat, gateways, get, metric, poll, post, start_worker

pytestmark = [pytest.mark.e2e, pytest.mark.redis_cluster]  # each test on standalone Redis and on a cluster

MODEL = "m"
WAIT_S = 10.0
CONFIG = f'[models."{MODEL}"]\ntotal = 8\n\n[routing]\nrefresh_ms = 100\nhit_feedback = true\n'


async def test_a_cache_reset_is_unlearnt_from_the_next_responses_cached_tokens(
    redis: aioredis.Redis, redis_url: str, tmp_path: Path
) -> None:
    runner, url = await start_worker(MODEL, "w0", time_scale=0.02)
    try:
        config = tmp_path / "kvgate.toml"
        config.write_text(CONFIG)
        gw = Gateway(redis_url, config, workers=[url], model=MODEL, log_dir=tmp_path)
        worker = static_worker_id(url)

        async def indexed() -> set[int]:
            return set((await index_store.load_snapshot(redis, MODEL)).get(worker, ()))

        def blocks(system: str, question: str) -> set[int]:
            """The request's approximate prefix blocks, as the gateway hashes them (chunk_chars 512)."""
            return set(hash_prompt(chat(MODEL, question, system=system, max_tokens=2), MODEL, 512).hashes)

        async def cached_tokens(system: str, question: str) -> int:
            """Ask through the gateway; the prompt tokens the worker reported cached."""
            body = chat(MODEL, question, system=system, max_tokens=2)
            status, headers, text = await post(f"{gw.url}/v1/chat/completions", body)
            assert status == 200, text
            assert headers["x-kvgate-worker"] == worker
            return int(json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"])

        older, newer = "Tenant A's long instructions. " * 150, "Tenant B's long instructions. " * 150
        async with gateways(gw):
            await cached_tokens(older, "first")

            async def older_indexed() -> bool:
                return bool(await indexed())

            await poll(older_indexed, WAIT_S, "the older prefix indexed", interval_s=0.05)
            old = await indexed()
            await cached_tokens(newer, "first")

            async def newer_indexed() -> bool:
                return len(await indexed()) > len(old)

            await poll(newer_indexed, WAIT_S, "the newer prefix indexed", interval_s=0.05)
            assert old == blocks(older, "first") and await indexed() == old | blocks(newer, "first")
            assert await cached_tokens(newer, "second") > 0  # the hit the index expected: nothing to unlearn
            assert old <= await indexed()

            async with aiohttp.ClientSession() as session, session.post(f"{url}/reset_prefix_cache") as resp:
                assert resp.status == 200  # the worker's cache is gone, as after a restart
            assert await cached_tokens(newer, "third") == 0

            async def unlearnt() -> bool:
                return not old & await indexed()

            await poll(unlearnt, WAIT_S, "the older prefix's entries removed from Redis", interval_s=0.05)
            reporter = blocks(newer, "third")
            assert reporter <= await indexed()  # its prefill cached them again
            first_tail = blocks(newer, "first") - reporter  # its own user message, used before the evidence
            assert first_tail and not first_tail & await indexed()
            _, text = await get(f"{gw.metrics_url}/metrics")
            dropped = metric(text.decode(), "kvgate_index_unlearnt_entries_total", model=MODEL, worker=worker)
            assert dropped is not None and dropped >= len(old)
    finally:
        await runner.cleanup()
