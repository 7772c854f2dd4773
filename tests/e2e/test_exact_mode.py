"""Exact prefix mode end to end: the gateway routes on the index the agents fill from KV events.

Needs: the embedded redis-server (tests/conftest.py), free loopback ports, ZMQ. Two emulated vLLM
workers (bench/emulator, in the test's loop) publish KV events; a `kvgate agent --kv-events` process
per worker indexes them; a `kvgate proxy` process runs with `prefix_mode = "exact"`. Prefixes are
warmed by sending requests straight to a worker, so only the agents' entries can tell the gateway
where they are. Stickiness and cold-start exploration are off in the gateway's config so that the
index alone decides. Every wait polls; every process is stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from bench import toy_model
from bench.emulator.tokenizer import render_chat, tokenize
from bench.stack import stop_process
from plugin.local_tokenizer import LocalTokenizer
from plugin.tokenize import request_namespace
from policy.prefix import chain_namespace, token_block_hashes
from store import index_store, registry
from store.redis_server import free_port
from tests.e2e.harness import Gateway, SseUpstream, chat, gateways, get, metric, poll, post, start_worker

pytestmark = pytest.mark.e2e

MODEL = "m"
WAIT_S = 20.0
SYSTEM = "You answer questions about the ACME rocket catalogue, politely and briefly. " * 30
CONFIG = f"""
[routing]
refresh_ms = 100
prefix_mode = "exact"

[routing.tuning.sticky]
window_s = 0.0

[routing.tuning.cold_start]
period_s = 0.0

[models."{MODEL}"]
total = 16
"""


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start `kvgate ...` subprocesses; every one is stopped at teardown."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "plugin.cli", *args], stdout=subprocess.DEVNULL)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_process(proc, 5)


@pytest.fixture
def worker_tokenizer() -> str | None:
    """A model directory the emulated workers tokenize with (None = their fake tokenizer)."""
    return None


@pytest.fixture
async def workers(
    redis: aioredis.Redis,
    redis_url: str,
    processes: Callable[..., subprocess.Popen[bytes]],
    worker_tokenizer: str | None,
) -> AsyncIterator[dict[str, str]]:
    """Worker id -> URL of two emulated workers with KV events, each registered by its exact-mode agent."""
    runners, urls = [], {}
    if worker_tokenizer is not None:
        toy_model.build(worker_tokenizer)  # made on the spot, the same for gateway and workers
    try:
        for wid in ("w0", "w1"):
            zmq = f"tcp://127.0.0.1:{free_port()}"
            runner, url = await start_worker(
                MODEL, wid, time_scale=0.02, kv_events_endpoint=zmq, tokenizer=worker_tokenizer
            )
            runners.append(runner)
            urls[wid] = url
            processes("agent", "--worker-url", url, "--model", MODEL, "--worker-id", wid,
                      "--redis", redis_url, "--heartbeat-ms", "100", "--kv-events", zmq)  # fmt: skip

        async def registered() -> bool:
            records = await registry.read_workers(redis, MODEL, 0)
            return sorted(r.id for r in records if r.router_block_size == 16) == ["w0", "w1"]

        await poll(registered, WAIT_S, "both agents registered with router block size 16", interval_s=0.05)
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


def prefix_keys(body: dict[str, object]) -> set[int]:
    """The index keys an agent writes for the blocks of this chat request."""
    ids = tokenize(render_chat(body["messages"]))
    return set(token_block_hashes(ids, model=MODEL, block_size=16)[0])


async def warm(redis: aioredis.Redis, url: str, wid: str, body: dict[str, object]) -> None:
    """Send `body` straight to one worker (not through the gateway) and wait for its agent's entries."""
    status, _, text = await post(f"{url}/v1/chat/completions", body)
    assert status == 200, text
    keys = prefix_keys(body)

    async def indexed() -> bool:
        return keys <= set((await index_store.load_snapshot(redis, MODEL)).get(wid, ()))

    await poll(indexed, WAIT_S, f"{wid}'s agent to index the warmed prefix", interval_s=0.05)


async def test_routes_to_the_holder_then_follows_a_cache_reset(
    redis: aioredis.Redis, redis_url: str, workers: dict[str, str], tmp_path: Path
) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text(CONFIG)
    gw = Gateway(redis_url, config, log_dir=tmp_path)
    async with gateways(gw):
        await warm(redis, workers["w1"], "w1", chat(MODEL, "warm-up", system=SYSTEM, max_tokens=2))
        served = []
        for i in range(3):
            status, headers, text = await post(
                f"{gw.url}/v1/chat/completions", chat(MODEL, f"question {i}", system=SYSTEM, max_tokens=2)
            )
            assert status == 200, text
            served.append(headers["x-kvgate-worker"])
        assert served == ["w1"] * 3

        # the worker drops its cache: its agent clears its entries, and the prefix now lives on w0 only
        status, _, _ = await post(f"{workers['w1']}/reset_prefix_cache", b"")
        assert status == 200
        keys = prefix_keys(chat(MODEL, "warm-up", system=SYSTEM))

        async def w1_cleared() -> bool:
            return not keys & set((await index_store.load_snapshot(redis, MODEL)).get("w1", ()))

        await poll(w1_cleared, WAIT_S, "w1's agent to clear its entries", interval_s=0.05)
        await warm(redis, workers["w0"], "w0", chat(MODEL, "warm-up again", system=SYSTEM, max_tokens=2))
        status, headers, text = await post(
            f"{gw.url}/v1/chat/completions", chat(MODEL, "after the reset", system=SYSTEM, max_tokens=2)
        )
        assert status == 200, text
        assert headers["x-kvgate-worker"] == "w0"
        _, text = await get(f"{gw.metrics_url}/metrics")
        assert metric(text.decode(), "kvgate_tokenize_total", model=MODEL, source="worker") == 4
        assert metric(text.decode(), "kvgate_prefix_fallbacks_total", model=MODEL) is None


async def test_tokenize_failure_falls_back_to_approximate(
    redis: aioredis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A worker without /tokenize (404): the request is still served, routed on approximate hashes."""
    config = tmp_path / "kvgate.toml"
    config.write_text(CONFIG)
    upstream = await SseUpstream(MODEL, events=2).start()
    upstream.release.set()
    try:
        gw = Gateway(redis_url, config, workers=[upstream.url], model=MODEL, log_dir=tmp_path)
        async with gateways(gw):
            status, _, text = await post(f"{gw.url}/v1/chat/completions", chat(MODEL, "hi", stream=True))
            assert status == 200 and b"[DONE]" in text
            _, metrics = await get(f"{gw.metrics_url}/metrics")
            assert metric(metrics.decode(), "kvgate_prefix_fallbacks_total", model=MODEL, reason="error") == 1
            assert metric(metrics.decode(), "kvgate_tokenize_total", model=MODEL) is None
    finally:
        await upstream.close()


async def test_lost_duplicated_and_reordered_event_batches_leave_no_stale_entries(
    redis: aioredis.Redis, workers: dict[str, str]
) -> None:
    """The emulated worker drops, duplicates or reorders KV-event batches on command; the agent resets
    that worker's index at a gap, skips repeats and stragglers, so no entry outlives its block."""
    url = workers["w1"]

    async def w1_keys() -> set[int]:
        return set((await index_store.load_snapshot(redis, MODEL)).get("w1", ()))

    old = chat(MODEL, "first", system=SYSTEM, max_tokens=2)
    await warm(redis, url, "w1", old)
    # lost: the batch that clears the cache never arrives; the next batch shows the gap
    assert (await post(f"{url}/kvgate/kv_faults", {"drop": 1}))[0] == 200
    assert (await post(f"{url}/reset_prefix_cache", b""))[0] == 200
    fresh = chat(MODEL, "second", system=SYSTEM.upper(), max_tokens=2)
    await warm(redis, url, "w1", fresh)
    assert not prefix_keys(old) & await w1_keys()  # stale entries of the dropped clear are gone

    # duplicated: applied once, nothing reset
    assert (await post(f"{url}/kvgate/kv_faults", {"duplicate": 1}))[0] == 200
    dup = chat(MODEL, "third", system=SYSTEM.lower(), max_tokens=2)
    await warm(redis, url, "w1", dup)
    assert prefix_keys(fresh) <= await w1_keys()

    # reordered: the later batch shows a gap (reset), the straggler is skipped
    assert (await post(f"{url}/kvgate/kv_faults", {"reorder": 1}))[0] == 200
    assert (await post(f"{url}/reset_prefix_cache", b""))[0] == 200  # held back, sent after the next
    last = chat(MODEL, "fourth", system=SYSTEM.title(), max_tokens=2)
    await warm(redis, url, "w1", last)
    assert not (prefix_keys(fresh) | prefix_keys(dup)) & await w1_keys()


TOY_DIR = Path(tempfile.gettempdir()) / f"kvgate-e2e-toy-{os.getpid()}"


@pytest.mark.parametrize("worker_tokenizer", [str(TOY_DIR)])
async def test_local_tokenizer_agrees_with_the_worker_and_routes_without_a_round_trip(
    redis: aioredis.Redis, redis_url: str, workers: dict[str, str], tmp_path: Path
) -> None:
    """Gateway and emulated workers load the same model directory (real BPE tokenizer.json, Llama 3
    template): the gateway's own ids equal the worker's /tokenize, its block hashes are the keys the
    agent wrote from the worker's KV events, and it routes to the holder with no /tokenize call."""
    tok = LocalTokenizer.load(TOY_DIR)
    config = tmp_path / "kvgate.toml"
    config.write_text(CONFIG + f'tokenizer = "{TOY_DIR}"\n')
    body = chat(MODEL, "Which rocket is fastest?", system=SYSTEM, max_tokens=2)
    status, _, text = await post(f"{workers['w1']}/tokenize", {"model": MODEL, "messages": body["messages"]})
    assert status == 200, text
    rendered, special = tok.prompt_text(body)
    assert json.loads(text)["tokens"] == tok.encode(rendered, special)  # token for token
    status, _, text = await post(f"{workers['w1']}/v1/chat/completions", body)
    assert status == 200, text
    keys = set(tok.blocks(body, MODEL, 16).hashes)

    async def indexed() -> bool:
        return keys <= set((await index_store.load_snapshot(redis, MODEL)).get("w1", ()))

    await poll(indexed, WAIT_S, "w1's agent to index the gateway's own block hashes", interval_s=0.05)
    gw = Gateway(redis_url, config, log_dir=tmp_path)
    async with gateways(gw):
        for i in range(3):
            status, headers, text = await post(
                f"{gw.url}/v1/chat/completions", chat(MODEL, f"question {i}", system=SYSTEM, max_tokens=2)
            )
            assert status == 200, text
            assert headers["x-kvgate-worker"] == "w1"
        _, text = await get(f"{gw.metrics_url}/metrics")
        assert metric(text.decode(), "kvgate_tokenize_total", model=MODEL, source="local") == 3
        assert metric(text.decode(), "kvgate_tokenize_total", model=MODEL, source="worker") is None


async def test_a_gap_is_resynced_from_the_replay_socket_and_without_one_the_index_is_reset(
    redis: aioredis.Redis, redis_url: str, processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """Two workers lose the same batch: the one with vLLM's replay socket gets it back (its index keeps
    every prefix it holds), the one without has its index reset (only what came after the gap)."""
    runners = []
    urls, agent_ports = {}, {}
    try:
        for wid, replay in (("r0", True), ("r1", False)):
            zmq_pub = f"tcp://127.0.0.1:{free_port()}"
            zmq_replay = f"tcp://127.0.0.1:{free_port()}" if replay else None
            runner, url = await start_worker(
                MODEL, wid, time_scale=0.02, kv_events_endpoint=zmq_pub, kv_events_replay_endpoint=zmq_replay
            )
            runners.append(runner)
            urls[wid] = url
            extra = ["--kv-events-replay", zmq_replay] if zmq_replay else []
            agent_ports[wid] = port = free_port()
            # r0's agent also probes its replay socket after half a quiet heartbeat (a lost tail batch);
            # a 1 s heartbeat keeps that probe from finding the lost batch before the next batch shows
            # the gap on a slow machine, so this test sees the gap path it is about
            heartbeat_ms = "1000" if replay else "100"
            extra += ["--port", str(port), "--heartbeat-ms", heartbeat_ms, "--router-block-size", "0"]
            processes("agent", "--worker-url", url, "--model", MODEL, "--worker-id", wid,
                      "--redis", redis_url, "--kv-events", zmq_pub, *extra)  # fmt: skip

        async def registered() -> bool:
            records = await registry.read_workers(redis, MODEL, 0)
            return sorted(r.id for r in records if r.router_block_size == 16) == ["r0", "r1"]

        # --router-block-size 0: the emulator's vllm:cache_config_info says block_size 16
        await poll(registered, WAIT_S, "both agents registered with the worker's block size", interval_s=0.05)
        first = chat(MODEL, "first", system=SYSTEM, max_tokens=2)
        lost = chat(MODEL, "lost", system=SYSTEM.upper(), max_tokens=2)
        after = chat(MODEL, "after", system=SYSTEM.lower(), max_tokens=2)
        for wid, url in urls.items():
            await warm(redis, url, wid, first)
            assert (await post(f"{url}/kvgate/kv_faults", {"drop": 1}))[0] == 200
            status, _, text = await post(f"{url}/v1/chat/completions", lost)  # its batch is lost
            assert status == 200, text
            await warm(redis, url, wid, after)  # the next batch shows the gap
        index = await index_store.load_snapshot(redis, MODEL)
        held = prefix_keys(first) | prefix_keys(lost) | prefix_keys(after)
        assert held <= set(index["r0"])  # replayed: whole
        assert prefix_keys(after) <= set(index["r1"]) and not prefix_keys(lost) & set(index["r1"])  # reset
        for wid, replayed in (("r0", 1.0), ("r1", 0.0)):
            _, body = await get(f"http://127.0.0.1:{agent_ports[wid]}/metrics")
            text = body.decode()
            assert metric(text, "kvgate_agent_kv_replays_total", worker=wid) == replayed
            assert metric(text, "kvgate_agent_kv_seq_gaps_total", worker=wid) == 1.0
    finally:
        for runner in runners:
            await runner.cleanup()


def two_free_ports() -> int:
    """A port p with p + 1 free too (vLLM's DP rank r publishes at the base port + r)."""
    import socket

    for _ in range(50):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports")


async def test_one_subscription_per_dp_rank_and_the_index_is_their_union(
    redis: aioredis.Redis, redis_url: str, processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """Two emulated engines publish as DP ranks 0 and 1 of one worker (ports p and p + 1); the agent
    subscribes to both, and a cache reset on rank 1 leaves rank 0's entries in the worker's index."""
    base = two_free_ports()
    runners, urls = [], []
    try:
        for rank in (0, 1):
            runner, url = await start_worker(
                MODEL, "dp", time_scale=0.02, kv_events_endpoint=f"tcp://127.0.0.1:{base + rank}"
            )
            runners.append(runner)
            urls.append(url)
        events = ["--kv-events", f"tcp://127.0.0.1:{base}", "--kv-events-dp-size", "2"]
        processes("agent", "--worker-url", urls[0], "--model", MODEL, "--worker-id", "dp",
                  "--redis", redis_url, "--heartbeat-ms", "100", *events)  # fmt: skip

        async def registered() -> bool:
            return [r.id for r in await registry.read_workers(redis, MODEL, 0)] == ["dp"]

        await poll(registered, WAIT_S, "the DP agent registered", interval_s=0.05)
        on0 = chat(MODEL, "rank zero", system=SYSTEM, max_tokens=2)
        on1 = chat(MODEL, "rank one", system=SYSTEM.upper(), max_tokens=2)
        await warm(redis, urls[0], "dp", on0)
        await warm(redis, urls[1], "dp", on1)
        assert (await post(f"{urls[1]}/reset_prefix_cache", b""))[0] == 200

        async def rank1_gone() -> bool:
            return not prefix_keys(on1) & set((await index_store.load_snapshot(redis, MODEL)).get("dp", ()))

        await poll(rank1_gone, WAIT_S, "rank 1's entries to go with its cache", interval_s=0.05)
        assert prefix_keys(on0) <= set((await index_store.load_snapshot(redis, MODEL))["dp"])
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_lora_adapters_and_cache_salts_get_keys_of_their_own(
    redis: aioredis.Redis, redis_url: str, processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """The same prompt under a LoRA adapter, under a cache_salt and plain: the worker's BlockStored
    carries lora_name / extra_keys, and the agent's keys are the gateway's for each (model or adapter
    name, salt) — three disjoint key sets, so none of them is taken for another's cache."""
    zmq_pub = f"tcp://127.0.0.1:{free_port()}"
    runner, url = await start_worker(
        MODEL, "lw", time_scale=0.02, kv_events_endpoint=zmq_pub, lora_adapters=("m-lora",)
    )
    try:
        processes("agent", "--worker-url", url, "--model", MODEL, "--worker-id", "lw",
                  "--redis", redis_url, "--heartbeat-ms", "100", "--kv-events", zmq_pub)  # fmt: skip

        async def registered() -> bool:
            return [r.id for r in await registry.read_workers(redis, MODEL, 0)] == ["lw"]

        await poll(registered, WAIT_S, "the agent registered", interval_s=0.05)
        plain = chat(MODEL, "same question", system=SYSTEM, max_tokens=2)
        ids = tokenize(render_chat(plain["messages"]))
        cases = [
            (plain, MODEL),
            ({**plain, "cache_salt": "tenant-7"}, chain_namespace(MODEL, ["tenant-7"])),
            ({**plain, "model": "m-lora"}, "m-lora"),
        ]
        seen: list[set[int]] = []
        for body, chain in cases:
            keys = set(token_block_hashes(ids, model=chain, block_size=16)[0])
            # the gateway hashes the request the same way
            assert request_namespace(body, str(body["model"])) == chain
            status, _, text = await post(f"{url}/v1/chat/completions", body)
            assert status == 200, text

            async def indexed(keys: set[int] = keys) -> bool:
                return keys <= set((await index_store.load_snapshot(redis, MODEL)).get("lw", ()))

            await poll(indexed, WAIT_S, f"the agent to index the {chain!r} prefix", interval_s=0.05)
            assert all(not keys & other for other in seen)
            seen.append(keys)
    finally:
        await runner.cleanup()


async def test_a_lost_tail_batch_comes_back_from_the_idle_probe_and_is_counted(
    redis: aioredis.Redis, redis_url: str, processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """The last batch is lost and no later batch shows the gap: the agent's probe of the replay socket
    after half a quiet heartbeat gets it back, and kvgate_agent_kv_tail_probe_recoveries_total counts it."""
    zmq_pub, zmq_replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    runner, url = await start_worker(
        MODEL, "t0", time_scale=0.02, kv_events_endpoint=zmq_pub, kv_events_replay_endpoint=zmq_replay
    )
    try:
        port = free_port()
        processes("agent", "--worker-url", url, "--model", MODEL, "--worker-id", "t0", "--redis", redis_url,
                  "--kv-events", zmq_pub, "--kv-events-replay", zmq_replay, "--port", str(port),
                  "--heartbeat-ms", "200", "--router-block-size", "0")  # fmt: skip

        async def registered() -> bool:
            return [r.id for r in await registry.read_workers(redis, MODEL, 0)] == ["t0"]

        await poll(registered, WAIT_S, "the agent registered", interval_s=0.05)
        first = chat(MODEL, "first", system=SYSTEM, max_tokens=2)
        lost = chat(MODEL, "lost", system=SYSTEM.upper(), max_tokens=2)
        await warm(redis, url, "t0", first)
        assert (await post(f"{url}/kvgate/kv_faults", {"drop": 1}))[0] == 200
        status, _, text = await post(f"{url}/v1/chat/completions", lost)  # the last batch, lost
        assert status == 200, text

        async def whole() -> bool:
            index = await index_store.load_snapshot(redis, MODEL)
            return prefix_keys(lost) <= set(index.get("t0", ()))

        await poll(whole, WAIT_S, "the lost tail batch is back in the index", interval_s=0.02)
        _, body = await get(f"http://127.0.0.1:{port}/metrics")
        assert metric(body.decode(), "kvgate_agent_kv_tail_probe_recoveries_total", worker="t0") == 1.0
        assert metric(body.decode(), "kvgate_agent_kv_seq_gaps_total", worker="t0") == 0.0
    finally:
        await runner.cleanup()
