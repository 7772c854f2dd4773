"""Scenarios: deterministic from the seed, Mooncake block-id semantics, and the stated sharing."""

from __future__ import annotations

import itertools

import pytest

from bench.sim.bounds import reusable_working_set_tokens
from bench.sim.scenarios import SCENARIOS, PromptBlocks, UnknownScenario, build_scenario, list_scenarios

NAMES = list(SCENARIOS)
WORKER_KV_TOKENS = 436_551  # h100-llama3.1-8b


def test_prompt_blocks_chain_whole_prefixes() -> None:
    pb = PromptBlocks(block_size=4)
    a_ids, a_sizes = pb.blocks([("sys", 6), ("u1", 3)])
    b_ids, b_sizes = pb.blocks([("sys", 6), ("u2", 3)])
    c_ids, _ = pb.blocks([("other", 4), ("sys", 6)])
    d_ids, d_sizes = pb.blocks([("sys", 8)])
    assert a_sizes == (4, 4, 1) and b_sizes == (4, 4, 1)
    assert a_ids[0] == b_ids[0]  # block 0 = sys[0:4] in both
    assert a_ids[1] != b_ids[1]  # block 1 mixes sys[4:6] with different user text
    assert c_ids[1] != a_ids[0]  # same content after a different prefix is a different block
    assert d_ids[0] == a_ids[0] and d_ids[1] != a_ids[1]
    assert d_sizes == (4, 4)
    assert pb.blocks([("sys", 6), ("u1", 3)]) == (a_ids, a_sizes)  # stable


def test_partial_last_block_never_shares_with_a_full_block() -> None:
    pb = PromptBlocks(block_size=4)
    short_ids, _ = pb.blocks([("x", 6)])
    long_ids, _ = pb.blocks([("x", 8)])
    assert short_ids[1] != long_ids[1]


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_requests(name: str) -> None:
    assert build_scenario(name, seed=7, limit=300) == build_scenario(name, seed=7, limit=300)
    assert build_scenario(name, seed=7, limit=300) != build_scenario(name, seed=8, limit=300)


@pytest.mark.parametrize("name", NAMES)
def test_requests_are_well_formed(name: str) -> None:
    reqs = build_scenario(name, seed=1, limit=500)
    assert len(reqs) == 500
    assert [r.id for r in reqs] == list(range(500))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    for r in reqs:
        assert sum(r.block_tokens) == r.input_tokens
        assert all(t == 512 for t in r.block_tokens[:-1]) and 0 < r.block_tokens[-1] <= 512
        assert r.output_tokens >= 1
    # Mooncake semantics: an id determines everything before it
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in reqs:
        for i, block_id in enumerate(r.block_ids):
            assert prefix_of.setdefault(block_id, r.block_ids[:i]) == r.block_ids[:i]


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        pytest.param("system_prompt", 0.0, 0.1, id="system_prompt fits one worker"),
        pytest.param("multi_turn", 1.0, 8.0, id="multi_turn exceeds one worker"),
        pytest.param("rag", 1.0, 8.0, id="rag exceeds one worker"),
        pytest.param("multi_tenant", 1.0, 8.0, id="multi_tenant exceeds one worker"),
    ],
)
def test_cache_pressure_as_stated(name: str, low: float, high: float) -> None:
    pressure = reusable_working_set_tokens(build_scenario(name, seed=1)) / WORKER_KV_TOKENS
    assert low < pressure < high


def test_multi_turn_history_grows_within_a_chat() -> None:
    reqs = build_scenario("multi_turn", seed=2, limit=400)
    # a later turn of a chat starts with the whole previous prompt's full blocks
    extended = sum(
        1
        for later in reqs
        for earlier in reqs[: later.id]
        if len(earlier.block_ids) > 2
        and later.block_ids[: len(earlier.block_ids) - 1] == earlier.block_ids[:-1]
        and later.input_tokens > earlier.input_tokens
    )
    assert extended > 100


def test_list_and_unknown() -> None:
    assert [n for n, _ in list_scenarios()] == NAMES
    assert all(help_text for _, help_text in list_scenarios())
    with pytest.raises(UnknownScenario, match="unknown scenario 'nope'"):
        build_scenario("nope", seed=1)
