"""Preble E2: exploit vs explore, windowed cost, allocation reset, rebalancing and replication."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.peers.preble import TPOT_INIT_S, PrebleRouter, gpus_of, make_router
from bench.sim.types import SimRequest
from tests.unit.bench.peers.fake_cluster import FakeCluster, request


def linear_prefill(new_tokens: int, ctx_tokens: int) -> float:
    """1 ms per new token: easy numbers for hand-made cases."""
    return new_tokens / 1000


def router(**kw: float) -> PrebleRouter:
    return PrebleRouter(linear_prefill, **kw)  # type: ignore[arg-type]


TWO = FakeCluster(["w0", "w1"])


def test_config_rejects_negative_rebalance_settings() -> None:
    with pytest.raises(ValueError, match="rebalance"):
        router(rebalance_after_per_gpu=-1)


def test_factory_builds_with_the_engine_profile_estimate() -> None:
    r = make_router(0)
    assert r.prefill_time(8192, 0) > r.prefill_time(512, 0) > 0


def test_first_request_explores_and_ties_go_to_registry_order() -> None:
    r = router()
    assert r.route(request([1, 2]), TWO, 0.0) == "w0"
    assert r.last_mode == "explore"


def test_cached_context_dominating_the_new_suffix_exploits_even_onto_the_busier_gpu() -> None:
    r = router()
    r.route(request([1, 2, 3], rid=1), TWO, 0.0)  # w0, still running
    assert r.cost("w0") > r.cost("w1") == 0.0
    # new suffix [4] = 512 tokens < cached context 1536 -> exploit the prefix's GPU
    assert r.route(request([1, 2, 3, 4], rid=2), TWO, 1.0) == "w0"
    assert r.last_mode == "exploit"


def test_new_suffix_not_smaller_than_cached_context_explores_to_least_cost() -> None:
    r = router()
    r.route(request([1], rid=1), TWO, 0.0)  # w0
    # suffix [5, 6] = 1024 tokens >= cached 512 -> explore -> w1 (w0 carries cost)
    assert r.route(request([1, 5, 6], rid=2), TWO, 1.0) == "w1"
    assert r.last_mode == "explore"


def test_cost_is_windowed_prefill_plus_active_decode() -> None:
    r = router()
    req = request([1, 2], rid=1, output=100)
    r.route(req, TWO, 0.0)
    # prefill: miss 1.0 x count 1 x 1.024 s / 1 GPU ; decode: 1 active x 100 tokens x 0.15 s
    assert r.cost("w0") == pytest.approx(1.024 + 100 * TPOT_INIT_S)
    r.on_first_token(req, "w0", 1.0)
    r.on_finish(req, "w0", 1.0 + 99 * 0.02)  # TPOT 20 ms joins the history (median of 0.15, 0.02)
    assert r.cost("w0") == pytest.approx(1.024)
    # the first request left the 3-minute window: w0 carries only the new request, with TPOT now
    # the median of (0.15, 0.02) = 0.085 s
    assert r.route(request([9], rid=2), TWO, 181.0) == "w0"
    assert r.cost("w0") == pytest.approx(0.512 + 10 * 0.085)
    assert gpus_of(r, [1, 2]) == set()  # allocation reset outside the window


def two_families_on_w0(r: PrebleRouter) -> None:
    """Families A=[1..4] and C=[20..23], each routed twice, all on w0 while it is the only worker."""
    one = FakeCluster(["w0"])
    for rid, blocks in enumerate([[1, 2, 3, 4], [1, 2, 3, 4, 5], [20, 21, 22, 23], [20, 21, 22, 23, 24]]):
        assert r.route(request(blocks, rid=rid), one, float(rid)) == "w0"


def test_rebalancing_moves_the_cheapest_important_node_to_the_light_gpu() -> None:
    r = router(rebalance_after_per_gpu=0, rebalance_min_interval_s=0)
    two_families_on_w0(r)
    assert gpus_of(r, [1, 2, 3, 4]) == gpus_of(r, [20, 21, 22, 23]) == {"w0"}
    r.route(request([50], rid=10), TWO, 10.0)  # w1 joins; this route triggers the rebalancing
    moved = [f for f in ([1, 2, 3, 4], [20, 21, 22, 23]) if gpus_of(r, f) == {"w1"}]
    assert len(moved) == 1  # moving the second would make w1 the heavier one
    # the moved family's next turn exploits onto its new GPU
    assert r.route(request([*moved[0], 99], rid=11), TWO, 11.0) == "w1"


def test_no_rebalancing_before_enough_requests() -> None:
    r = router(rebalance_after_per_gpu=50, rebalance_min_interval_s=0)
    two_families_on_w0(r)
    r.route(request([50], rid=10), TWO, 10.0)
    assert gpus_of(r, [1, 2, 3, 4]) == gpus_of(r, [20, 21, 22, 23]) == {"w0"}


@pytest.mark.parametrize(
    ("late_ttft_s", "replicated"),
    [
        pytest.param(2.0, True, id="TTFT doubled in the 2nd half of the window -> replicate"),
        pytest.param(1.5, False, id="TTFT grew 1.5x -> keep one GPU"),
    ],
)
def test_single_hot_node_is_replicated_when_its_ttft_doubles(late_ttft_s: float, replicated: bool) -> None:
    r = router(rebalance_after_per_gpu=0, rebalance_min_interval_s=0)
    one = FakeCluster(["w0"])
    rid = 0
    for t, ttft in [(0.0, 1.0), (10.0, 1.0), (100.0, late_ttft_s), (110.0, late_ttft_s)]:
        req = request([1, 2, 3, 4, 100 + rid], rid=rid)
        r.route(req, one, t)
        r.on_first_token(req, "w0", t + ttft)
        r.on_finish(req, "w0", t + ttft + 1.0)
        rid += 1
    r.route(request([1, 2, 3, 4, 999], rid=rid), TWO, 120.0)  # w1 joins, rebalancing runs
    assert gpus_of(r, [1, 2, 3, 4]) == ({"w0", "w1"} if replicated else {"w0"})


def test_a_moved_subtree_takes_existing_branches_with_it() -> None:
    r = router(rebalance_after_per_gpu=0, rebalance_min_interval_s=0)
    two_families_on_w0(r)
    r.route(request([50], rid=10), TWO, 10.0)
    family = next(f for f in ([1, 2, 3, 4], [20, 21, 22, 23]) if gpus_of(r, f) == {"w1"})
    # the branch routed before the move (family + one block) was allocated to w0 on its own;
    # the move re-allocated it with its parent, so its next turn follows to w1
    assert r.route(request([*family, family[-1] + 1, 77], rid=11), TWO, 11.0) == "w1"
    assert r.last_mode == "exploit"


def test_without_rebalancing_nothing_moves() -> None:
    r = PrebleRouter(linear_prefill, rebalance_after_per_gpu=0, rebalance_min_interval_s=0, rebalance=False)
    two_families_on_w0(r)
    r.route(request([50], rid=10), TWO, 10.0)
    assert gpus_of(r, [1, 2, 3, 4]) == gpus_of(r, [20, 21, 22, 23]) == {"w0"}


def costs_from_scratch(r: PrebleRouter) -> dict[str, float]:
    """The upstream formula evaluated over the whole tree (what the incremental sums must equal)."""
    total = dict.fromkeys(r._gpus, 0.0)
    stack = [r.tree.root]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        s = n.stats
        if s is None or not s.in_window or not n.alloc or not s.prompt_tokens:
            continue
        miss = 1 - s.hit_tokens / s.prompt_tokens
        prefill = (
            miss * s.count * r.prefill_time(n.num_tokens, n.context_length - n.num_tokens) / len(n.alloc)
        )
        for g in n.alloc:
            if g in total:
                total[g] += prefill + n.ref.get(g, 0) * s.out_len() * r.costs.tpot(g)
    return total


@given(
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=5),  # prompt as a path in a small id space
            st.floats(0.0, 100.0),  # gap before it arrives
            st.integers(0, 2),  # how many of the oldest running requests finish first
        ),
        min_size=1,
        max_size=25,
    )
)
@settings(max_examples=60, deadline=None)
def test_incremental_costs_equal_the_formula_from_scratch(steps: list[tuple[list[int], float, int]]) -> None:
    r = router(rebalance_after_per_gpu=0, rebalance_min_interval_s=0)
    cluster = FakeCluster(["w0", "w1", "w2"])
    running: list[tuple[SimRequest, str]] = []
    now = 0.0
    for rid, (digits, gap, finishes) in enumerate(steps):
        now += gap
        for req, gpu in running[:finishes]:
            r.on_first_token(req, gpu, now)
            r.on_finish(req, gpu, now)
        del running[:finishes]
        # chained ids: the id of block i encodes the whole path 0..i
        ids = [int("1" + "".join(str(d) for d in digits[: i + 1])) for i in range(len(digits))]
        req = request(ids, rid=rid, output=5)
        running.append((req, r.route(req, cluster, now)))
        expected = costs_from_scratch(r)
        for g in cluster.workers:
            assert r.cost(g) == pytest.approx(expected[g], abs=1e-6)
