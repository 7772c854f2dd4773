"""KV events: engine keys become vLLM array-encoded events that vLLM's decoder reads back."""

from __future__ import annotations

import msgpack
import pytest

from bench.emulator.kv_events import BlockCatalog, encode_batch, to_vllm_events
from bench.emulator.tokenizer import full_block_keys

# --- the msgpack part of shared/reference/vllm_kv_compat.py (decode_batch), copied verbatim in logic:
# the reference module needs cbor2 at import, which kvgate does not install.
U64 = (1 << 64) - 1
EVENT_FIELDS = {
    "BlockStored": [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ],
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
}


def _norm_hash(x):
    if x is None:
        return None
    if isinstance(x, (bytes, bytearray)):
        return int.from_bytes(bytes(x[-8:]).rjust(8, b"\0"), "big")
    return x & U64


def decode_batch(payload: bytes):
    b = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(b, dict):
        ts, events, dp = b.get("ts"), b.get("events", []), b.get("data_parallel_rank")
    else:
        ts, events = b[0], b[1]
        dp = b[2] if len(b) > 2 else None
    out = []
    for e in events:
        if isinstance(e, dict):
            d = dict(e)
            tag = d.pop("type")
        else:
            tag = e[0]
            d = {k: (e[i + 1] if i + 1 < len(e) else None) for i, k in enumerate(EVENT_FIELDS.get(tag, []))}
        if "block_hashes" in d and d["block_hashes"] is not None:
            d["block_hashes"] = [_norm_hash(h) for h in d["block_hashes"]]
        if "parent_block_hash" in d:
            d["parent_block_hash"] = _norm_hash(d["parent_block_hash"])
        d["type"] = tag
        out.append(d)
    return ts, dp, out


# --- fixtures: two prompts sharing their first block
SHARED = list(range(100, 116))
PROMPT_A = SHARED + list(range(200, 232))  # 3 full blocks
PROMPT_B = SHARED + list(range(300, 316)) + [7, 7, 7]  # 2 full blocks + a partial one
KEYS_A = full_block_keys(PROMPT_A, 16)
KEYS_B = full_block_keys(PROMPT_B, 16)
PARTIAL_KEY = 12345  # the engine knows the partial block under a key nobody else uses


def catalog() -> BlockCatalog:
    c = BlockCatalog(max_blocks=100)
    c.remember(KEYS_A, PROMPT_A, 16)
    c.remember(KEYS_B, PROMPT_B, 16)
    return c


def test_a_chain_of_stored_blocks_is_one_block_stored_with_all_its_tokens() -> None:
    events = to_vllm_events([("stored", KEYS_A)], catalog(), 16)
    assert events == [["BlockStored", KEYS_A, None, PROMPT_A, 16, None, "GPU", None, None]]


def test_stored_blocks_that_do_not_chain_split_into_events_with_their_parents() -> None:
    events = to_vllm_events([("stored", [*KEYS_A, KEYS_B[1], PARTIAL_KEY])], catalog(), 16)
    assert events == [
        ["BlockStored", KEYS_A, None, PROMPT_A, 16, None, "GPU", None, None],
        ["BlockStored", [KEYS_B[1]], KEYS_B[0], PROMPT_B[16:32], 16, None, "GPU", None, None],
    ]


@pytest.mark.parametrize(
    ("engine_events", "expected"),
    [
        pytest.param(
            [("removed", [KEYS_A[2], PARTIAL_KEY])],
            [["BlockRemoved", [KEYS_A[2]], "GPU"]],
            id="removal skips the partial block",
        ),
        pytest.param([("removed", [PARTIAL_KEY])], [], id="removal of only a partial block says nothing"),
        pytest.param([("stored", [PARTIAL_KEY])], [], id="a partial block is never stored"),
        pytest.param([("cleared", [])], [["AllBlocksCleared"]], id="cleared"),
    ],
)
def test_removed_and_cleared(engine_events: list, expected: list) -> None:
    assert to_vllm_events(engine_events, catalog(), 16) == expected


def test_unknown_engine_event_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown"):
        to_vllm_events([("moved", [1])], catalog(), 16)


def test_catalog_is_bounded() -> None:
    c = BlockCatalog(max_blocks=2)
    c.remember(KEYS_A, PROMPT_A, 16)
    assert len(c) == 2
    assert c.get(KEYS_A[0]) is None and c.get(KEYS_A[2]) is not None


def test_batches_decode_with_vllms_reference_decoder() -> None:
    events = to_vllm_events([("stored", KEYS_A), ("removed", [KEYS_A[2]]), ("cleared", [])], catalog(), 16)
    ts, dp, decoded = decode_batch(encode_batch(1700000000.5, events))
    assert (ts, dp) == (1700000000.5, 0)
    assert [d["type"] for d in decoded] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    stored = decoded[0]
    assert stored["block_hashes"] == KEYS_A
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == PROMPT_A
    assert stored["block_size"] == 16
    assert stored["medium"] == "GPU"
    assert stored["lora_name"] is None  # omitted trailing fields decode as nil
    assert decoded[1]["block_hashes"] == [KEYS_A[2]]
    assert decoded[1]["medium"] == "GPU"
