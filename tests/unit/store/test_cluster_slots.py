"""Every key a script (or a transaction) touches for one model hashes to one Redis Cluster slot, and
the slot map of the local cluster covers all 16384 slots; tests/e2e run the scripts on a real cluster."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from store import index_store, keys
from store.redis_cluster import SLOTS, slot_ranges
from store.scripts import model_keys

MODELS = ["m", "llama", "meta-llama/Llama-3.1-8B-Instruct", "a:b", "qwen2.5-7b"]


@pytest.mark.parametrize("model", MODELS)
def test_all_keys_of_one_model_share_a_slot(model: str) -> None:
    every = [
        *model_keys(model, worker="w1"),  # the admission scripts' KEYS, with the two-step worker hash
        keys.workers(model), keys.worker(model, "w1"), keys.worker(model, ""),  # registry, Lua prefix
        index_store.index_key(model, "w1"), index_store.members_key(model),
        index_store.seq_key(model), index_store.log_key(model),
    ]  # fmt: skip
    assert {key_slot(k.encode()) for k in every} == {key_slot(keys.model_key(model).encode())}


def test_models_spread_over_the_masters() -> None:
    ranges = slot_ranges(3)
    owners = {
        next(i for i, r in enumerate(ranges) if key_slot(keys.model_key(m).encode()) in r) for m in MODELS
    }
    assert len(owners) > 1


@pytest.mark.parametrize("masters", [1, 2, 3, 7])
def test_slot_ranges_cover_every_slot_once(masters: int) -> None:
    ranges = slot_ranges(masters)
    assert [s for r in ranges for s in r] == list(range(SLOTS))
    assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1
