"""The prefix-index store on a real Redis: add, capacity trim, remove, clear, snapshot, log tail."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store import index_store
from store.connect import redis_from_url
from store.index_store import IndexOp

pytestmark = pytest.mark.redis_cluster  # each test on standalone Redis and on a cluster

MODEL = "m"


async def test_add_then_snapshot_lists_blocks_most_recent_first(redis: aioredis.Redis) -> None:
    await index_store.add_blocks(redis, MODEL, "w1", [1, 2, 3], now_ms=1000)
    await index_store.add_blocks(redis, MODEL, "w2", [1], now_ms=1000)
    await index_store.add_blocks(redis, MODEL, "w1", [7], now_ms=2000)
    snap = await index_store.load_snapshot(redis, MODEL)
    # within one add the head block ranks as more recent than the tail
    assert snap == {"w1": [7, 1, 2, 3], "w2": [1]}


async def test_hashes_are_stored_as_16_hex_digits(redis: aioredis.Redis) -> None:
    await index_store.add_blocks(redis, MODEL, "w1", [0xAB, (1 << 64) - 1], now_ms=1)
    members = await redis.zrange(index_store.index_key(MODEL, "w1"), 0, -1)
    assert sorted(members) == [b"00000000000000ab", b"ffffffffffffffff"]


@pytest.mark.parametrize(
    ("adds", "capacity", "kept", "evicted"),
    [
        pytest.param([[1, 2, 3]], 5, [1, 2, 3], 0, id="under capacity: nothing evicted"),
        pytest.param([[1, 2, 3, 4]], 2, [1, 2], 2, id="one long prefix: tail evicted first"),
        pytest.param([[1, 2], [3, 4]], 2, [3, 4], 2, id="older prefix evicted before newer"),
        pytest.param([[1, 2], [3], [1]], 2, [1, 3], 1, id="re-used block refreshed, not evicted"),
    ],
)
async def test_capacity_trim_keeps_most_recent(
    redis: aioredis.Redis, adds: list[list[int]], capacity: int, kept: list[int], evicted: int
) -> None:
    total = 0
    for t, hashes in enumerate(adds):
        total += await index_store.add_blocks(
            redis, MODEL, "w1", hashes, now_ms=1000 * (t + 1), capacity_blocks=capacity
        )
    snap = await index_store.load_snapshot(redis, MODEL)
    assert sorted(snap["w1"]) == kept
    assert total == evicted


async def test_remove_and_clear(redis: aioredis.Redis) -> None:
    await index_store.add_blocks(redis, MODEL, "w1", [1, 2, 3], now_ms=1)
    await index_store.add_blocks(redis, MODEL, "w2", [4], now_ms=1)
    assert await index_store.remove_blocks(redis, MODEL, "w1", [2, 99]) == 1
    assert await index_store.load_snapshot(redis, MODEL) == {"w1": [1, 3], "w2": [4]}
    assert await index_store.clear_worker(redis, MODEL, "w1") == 2
    assert await index_store.load_snapshot(redis, MODEL) == {"w2": [4]}


async def test_forget_before_drops_entries_used_before_and_logs_them(redis: aioredis.Redis) -> None:
    await index_store.add_blocks(redis, MODEL, "w1", [1, 2], now_ms=1000)
    await index_store.add_blocks(redis, MODEL, "w1", [3], now_ms=2000)
    await index_store.add_blocks(redis, MODEL, "w2", [1], now_ms=1000)
    cursor = await index_store.log_cursor(redis, MODEL)
    assert await index_store.forget_before(redis, MODEL, "w1", 2000) == 2
    assert await index_store.load_snapshot(redis, MODEL) == {"w1": [3], "w2": [1]}  # w2 is not w1
    _, ops = await index_store.tail(redis, MODEL, cursor)
    assert [(op.op, op.worker, sorted(op.hashes)) for op in ops] == [("remove", "w1", [1, 2])]
    assert await index_store.forget_before(redis, MODEL, "w1", 2000) == 0  # nothing older: nothing logged
    assert (await index_store.tail(redis, MODEL, cursor))[1] == ops
    await index_store.add_blocks(redis, MODEL, "w1", [4, 5], now_ms=2500)
    assert await index_store.forget_before(redis, MODEL, "w1", 3000, keep=[4]) == 2  # 3 and 5; 4 is kept
    assert await index_store.load_snapshot(redis, MODEL) == {"w1": [4], "w2": [1]}


async def test_tail_returns_ops_in_order_including_trim_evictions(redis: aioredis.Redis) -> None:
    cursor = await index_store.log_cursor(redis, MODEL)
    assert cursor == "0-0@0"
    await index_store.add_blocks(redis, MODEL, "w1", [1, 2], now_ms=1, capacity_blocks=1)
    await index_store.remove_blocks(redis, MODEL, "w1", [1])
    await index_store.clear_worker(redis, MODEL, "w1")
    cursor, ops = await index_store.tail(redis, MODEL, cursor)
    assert ops == [
        IndexOp("add", "w1", (1, 2), seq=1),
        IndexOp("remove", "w1", (2,), seq=2),
        IndexOp("remove", "w1", (1,), seq=3),
        IndexOp("clear", "w1", (), seq=4),
    ]
    assert cursor == await index_store.log_cursor(redis, MODEL)
    assert cursor.endswith("@4")
    assert await index_store.tail(redis, MODEL, cursor) == (cursor, [])


async def test_a_reader_that_fell_behind_the_trimmed_log_is_told_to_resnapshot(redis: aioredis.Redis) -> None:
    await index_store.add_blocks(redis, MODEL, "w1", [1], now_ms=1)
    behind = await index_store.log_cursor(redis, MODEL)
    for h in range(2, 6):
        await index_store.add_blocks(redis, MODEL, "w1", [h], now_ms=h)
    # a bare stream id (no seq) cannot tell; a cursor can
    await redis.xtrim(index_store.log_key(MODEL), maxlen=2, approximate=False)
    with pytest.raises(index_store.IndexLogGap, match=r"entries 2\.\.3 were trimmed"):
        await index_store.tail(redis, MODEL, behind)
    _, ops = await index_store.tail(redis, MODEL, behind.partition("@")[0])
    assert [op.seq for op in ops] == [4, 5]


async def test_thousands_of_blocks_in_one_call(redis: aioredis.Redis) -> None:
    """Lua's unpack() holds a few thousand values: long prompts and batched writes go in chunks."""
    hashes = list(range(1, 20_001))
    assert await index_store.add_blocks(redis, MODEL, "w1", hashes, now_ms=1, capacity_blocks=15_000) == 5_000
    assert len((await index_store.load_snapshot(redis, MODEL))["w1"]) == 15_000
    assert await index_store.remove_blocks(redis, MODEL, "w1", hashes) == 15_000


async def test_tail_blocks_until_an_op_arrives(redis_url: str, redis: aioredis.Redis) -> None:
    import asyncio

    reader = redis_from_url(redis_url)
    try:
        cursor = await index_store.log_cursor(redis, MODEL)
        waiting = asyncio.ensure_future(index_store.tail(reader, MODEL, cursor, block_ms=5000))
        await index_store.add_blocks(redis, MODEL, "w9", [5], now_ms=1)
        _, ops = await asyncio.wait_for(waiting, 5)
        assert ops == [IndexOp("add", "w9", (5,), seq=1)]
    finally:
        await reader.aclose()


async def test_reserved_worker_id_is_rejected() -> None:
    with pytest.raises(ValueError, match="reserved"):
        index_store.index_key(MODEL, "log")


ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "clear"]),
        st.sampled_from(["w1", "w2"]),
        st.lists(st.integers(0, 6), max_size=4),
    ),
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops_strategy, capacity=st.integers(1, 5), replay_from=st.integers(0, 12))
async def test_mirror_from_snapshot_plus_log_equals_redis(
    redis: aioredis.Redis, ops: list[tuple[str, str, list[int]]], capacity: int, replay_from: int
) -> None:
    """Invariant: cursor, then snapshot, then tail (even replaying ops the snapshot has) == Redis; bounded."""
    await redis.flushdb()
    cursor = "0-0"
    for i, (op, worker, hashes) in enumerate(ops):
        if i == replay_from:
            cursor = await index_store.log_cursor(redis, MODEL)
        if op == "add":
            await index_store.add_blocks(redis, MODEL, worker, hashes, now_ms=i, capacity_blocks=capacity)
        elif op == "remove":
            await index_store.remove_blocks(redis, MODEL, worker, hashes)
        else:
            await index_store.clear_worker(redis, MODEL, worker)
    truth = await index_store.load_snapshot(redis, MODEL)
    mirror: dict[str, dict[int, None]] = {w: dict.fromkeys(hs) for w, hs in truth.items()}
    _, log = await index_store.tail(redis, MODEL, cursor)
    index_store.apply_ops(mirror, log)
    assert {w: set(hs) for w, hs in mirror.items() if hs} == {w: set(hs) for w, hs in truth.items()}
    assert all(len(hs) <= capacity for hs in truth.values())
