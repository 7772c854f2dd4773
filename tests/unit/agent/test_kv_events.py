"""KV-event decoding (both vLLM wire encodings, built with msgpack here) and router-key mapping."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.kv_consumer import KvEventStats
from agent.kv_events import (
    IndexChange,
    KvEvent,
    KvEventDecodeError,
    RouterKeys,
    continue_chain,
    decode_batch,
    engine_hash,
)
from policy.prefix import token_block_hashes

MODEL = "m"
TOKENS = list(range(1000, 1064))  # 4 blocks of 16


def keys_of(tokens: list[int], block_size: int = 16) -> tuple[int, ...]:
    return token_block_hashes(tokens, model=MODEL, block_size=block_size)[0]


def stored_array(
    hashes: list[object], parent: object, tokens: list[int], medium: str | None = "GPU"
) -> list[object]:
    return ["BlockStored", hashes, parent, tokens, 16, None, medium]


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        pytest.param(
            [1.5, [stored_array([11, 12], None, TOKENS[:32])], 0],
            KvEvent("BlockStored", (11, 12), None, tuple(TOKENS[:32]), 16, "GPU"),
            id="array encoding (vLLM <= 0.23)",
        ),
        pytest.param(
            [1.5, [["BlockStored", [11], 10, TOKENS[:16], 16]]],
            KvEvent("BlockStored", (11,), 10, tuple(TOKENS[:16]), 16, None),
            id="array encoding, old 2-element batch, trailing fields omitted",
        ),
        pytest.param(
            [1.5, [{"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None,
                    "token_ids": TOKENS[:16], "block_size": 16, "lora_id": None, "medium": "GPU",
                    "lora_name": None, "extra_keys": [None], "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention"}], 0],
            KvEvent("BlockStored", (11,), None, tuple(TOKENS[:16]), 16, "GPU"),
            id="map encoding (vLLM >= 0.26)",
        ),
        pytest.param(
            {"ts": 2.0, "events": [{"type": "BlockRemoved", "block_hashes": [11, 12]}],
             "data_parallel_rank": 1},
            KvEvent("BlockRemoved", (11, 12)),
            id="map-encoded batch",
        ),
        pytest.param(
            [1.0, [["BlockRemoved", [b"\x01" * 24 + b"\x00" * 7 + b"\x05"], "GPU"]], 0],
            KvEvent("BlockRemoved", (5,), medium="GPU"),
            id="bytes hash: last 8 bytes big-endian",
        ),
        pytest.param([1.0, [["AllBlocksCleared"]], 0], KvEvent("AllBlocksCleared"), id="all blocks cleared"),
    ],
)  # fmt: skip
def test_decode_batch_both_encodings(payload: object, expected: KvEvent) -> None:
    batch = decode_batch(msgpack.packb(payload))
    assert batch.events == (expected,)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"\xc1", id="not msgpack"),
        pytest.param(msgpack.packb(7), id="not a batch"),
        pytest.param(msgpack.packb([1.0, [7]]), id="event neither array nor map"),
        pytest.param(msgpack.packb([1.0, [["BlockRemoved", ["x"]]]]), id="hash neither int nor bytes"),
    ],
)
def test_decode_batch_rejects_garbage(payload: bytes) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_batch(payload)


def test_engine_hash_masks_to_64_bits() -> None:
    assert engine_hash(-1) == (1 << 64) - 1
    assert engine_hash(None) is None


def test_continue_chain_equals_hashing_the_whole_prefix() -> None:
    whole = keys_of(TOKENS)
    assert continue_chain(None, TOKENS[:32], model=MODEL, block_size=16) == list(whole[:2])
    assert continue_chain(whole[1], TOKENS[32:], model=MODEL, block_size=16) == list(whole[2:])


def test_stored_blocks_map_to_router_keys_and_children_continue_the_chain() -> None:
    keys = RouterKeys(MODEL, 16)
    first = keys.apply(KvEvent("BlockStored", (101, 102), None, tuple(TOKENS[:32]), 16, "GPU"))
    child = keys.apply(KvEvent("BlockStored", (103,), 102, tuple(TOKENS[32:48]), 16, "GPU"))
    assert first == IndexChange("add", keys_of(TOKENS)[:2])
    assert child == IndexChange("add", keys_of(TOKENS)[2:3])
    assert keys.apply(KvEvent("BlockRemoved", (102, 999))) == IndexChange("remove", keys_of(TOKENS)[1:2])
    assert keys.apply(KvEvent("BlockRemoved", (999,))) is None


@pytest.mark.parametrize("router_block_size", [8, 16, 32], ids=lambda b: f"router block {b} vs engine 16")
def test_router_block_size_may_differ_from_engine(router_block_size: int) -> None:
    keys = RouterKeys(MODEL, router_block_size)
    added: list[int] = []
    for i in range(4):
        parent = 200 + i - 1 if i else None
        change = keys.apply(
            KvEvent("BlockStored", (200 + i,), parent, tuple(TOKENS[16 * i : 16 * (i + 1)]), 16)
        )
        added += change.keys if change else ()
    assert tuple(added) == keys_of(TOKENS, router_block_size)


def test_unknown_parent_and_non_gpu_blocks_are_skipped() -> None:
    keys = RouterKeys(MODEL, 16)
    assert keys.apply(KvEvent("BlockStored", (2,), 1, tuple(TOKENS[:16]), 16, "GPU")) is None
    assert keys.unknown_parents == 1
    assert keys.apply(KvEvent("BlockStored", (3,), None, tuple(TOKENS[:16]), 16, "CPU")) is None
    assert keys.apply(KvEvent("BlockStored", (4,), None, (), 16, "GPU")) is None
    assert len(keys) == 0


def test_all_blocks_cleared_forgets_chains() -> None:
    keys = RouterKeys(MODEL, 16)
    keys.apply(KvEvent("BlockStored", (1,), None, tuple(TOKENS[:16]), 16))
    assert keys.apply(KvEvent("AllBlocksCleared")) == IndexChange("clear")
    assert keys.apply(KvEvent("BlockStored", (2,), 1, tuple(TOKENS[16:32]), 16)) is None


def test_chain_map_is_bounded() -> None:
    keys = RouterKeys(MODEL, 16, max_blocks=3)
    for i in range(10):
        keys.apply(KvEvent("BlockStored", (i,), None, tuple(TOKENS[:16]), 16))
    assert len(keys) == 3


@pytest.mark.parametrize(
    ("seqs", "result", "gaps", "missed"),
    [
        pytest.param([0, 1, 2], [None, None, None], 0, 0, id="consecutive"),
        pytest.param([0, 3], [None, "gap"], 1, 2, id="two batches missed"),
        pytest.param([5, 6, 0], [None, None, "reset"], 0, 0, id="publisher restarted"),
        pytest.param([0, 1, 1, 2], [None, None, "duplicate", None], 0, 0, id="duplicate skipped"),
        pytest.param([0, 2, 1, 3], [None, "gap", "late", None], 1, 1, id="reordered: gap, then late"),
        pytest.param([500, 501, 3], [None, None, "reset"], 0, 0, id="far back: restarted"),
    ],
)
def test_seq_accounting(seqs: list[int], result: list[str | None], gaps: int, missed: int) -> None:
    stats = KvEventStats()
    assert [stats.observe_seq(b"t", s) for s in seqs] == result
    assert (stats.seq_gaps, stats.missed_batches) == (gaps, missed)


@settings(max_examples=60, deadline=None)
@given(
    n_tokens=st.integers(0, 120),
    engine_block=st.sampled_from([4, 8, 16]),
    router_block=st.sampled_from([4, 8, 16, 32]),
    batch_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=40),
)
def test_router_keys_equal_hashing_the_whole_prompt(
    n_tokens: int, engine_block: int, router_block: int, batch_sizes: list[int]
) -> None:
    """Invariant: however the engine splits a prompt into stored-block events, the router keys added are
    exactly the chained hashes of the prompt's full router blocks, in order."""
    tokens = list(range(7, 7 + n_tokens))
    blocks = len(tokens) // engine_block
    keys = RouterKeys(MODEL, router_block)
    added: list[int] = []
    start, sizes = 0, iter(batch_sizes * (blocks + 1))
    while start < blocks:
        count = min(next(sizes), blocks - start)
        event = KvEvent(
            "BlockStored",
            tuple(range(start + 1, start + count + 1)),  # engine hashes: opaque ids
            start if start else None,
            tuple(tokens[start * engine_block : (start + count) * engine_block]),
            engine_block,
        )
        change = keys.apply(event)
        added += change.keys if change else ()
        start += count
    covered = tokens[: blocks * engine_block]
    assert tuple(added) == keys_of(covered, router_block)
