"""policy/feedback.py and its index side: what a reported cached count proves stale, and what goes."""

from __future__ import annotations

import pytest

from policy.config import RoutingConfig
from policy.feedback import reported_blocks, scaled_cached_tokens, stale_before
from policy.index import PrefixIndex
from policy.state import RoutingState
from policy.types import Decision, WorkerView

BLOCKS = (512, 512, 512, 512, 100)


@pytest.mark.parametrize(
    ("cached", "expected"),
    [(0, 0), (511, 0), (512, 1), (1500, 2), (2048, 4), (2148, 5), (10_000, 5)],
)
def test_reported_blocks_counts_wholly_covered_leading_blocks(cached: int, expected: int) -> None:
    assert reported_blocks(cached, BLOCKS) == expected


@pytest.mark.parametrize(
    ("cached", "touched", "stale"),
    [
        pytest.param(2048, [9.0, 8.0, 7.0, 6.0], None, id="report agrees"),
        pytest.param(1536, [9.0, 8.0, 7.0, 6.0], None, id="one block short: slack (last-block recompute)"),
        pytest.param(1024, [9.0, 8.0, 7.0, 6.0], 7.0, id="block 2 missing: older than its last touch"),
        pytest.param(0, [9.0, 8.0, 7.0, 6.0], 9.0, id="nothing cached: older than the root (restart)"),
        pytest.param(0, [9.0], None, id="one expected block cannot be contradicted"),
        pytest.param(0, [], None, id="no expectation"),
    ],
)
def test_stale_before(cached: int, touched: list[float], stale: float | None) -> None:
    assert stale_before(cached, BLOCKS, touched) == stale


def test_scaled_cached_tokens_carries_the_cached_share_over() -> None:
    assert scaled_cached_tokens(500, 1000, 1200) == 600  # estimated tokens: chars ÷ 4
    assert scaled_cached_tokens(500, None, 1200) == 500  # no prompt count reported: as is


def test_touch_times_follow_the_last_touch_and_forget_before_drops_the_oldest() -> None:
    idx = PrefixIndex(100)
    idx.insert("w", [1, 2, 3], 1.0)
    idx.insert("w", [4, 5], 2.0)
    idx.insert("w", [1, 6], 3.0)  # 1 touched again
    idx.insert("v", [1, 2], 0.5)
    assert idx.touched_s("w", [1, 2, 3, 9]) == [3.0, 1.0, 1.0]  # up to the first absent block
    assert idx.touched_s("w", [9, 1]) == []
    assert sorted(idx.forget_before("w", 2.0)) == [2, 3]
    assert idx.match([1, 2, 3]) == {"w": 1, "v": 2}  # v's entries are another worker's: kept
    assert idx.match([4, 5]) == {"w": 2}
    assert idx.forget_before("w", 2.0) == []
    assert sorted(idx.forget_before("w", 10.0)) == [1, 4, 5, 6]
    assert idx.size("w") == 0 and idx.holders(1) == frozenset({"v"})


def view_of(worker: str) -> WorkerView:
    return WorkerView(
        id=worker, running=0, waiting=0, kv_usage=0.0, capacity_tokens=100_000, max_concurrency=8
    )


def test_state_unlearns_a_restart_but_keeps_what_was_routed_since() -> None:
    state = RoutingState(RoutingConfig(policy="kvgate"), PrefixIndex(1000))
    workers = [view_of("w0"), view_of("w1")]
    tokens = (512,) * 4

    def routed(hashes: tuple[int, ...], worker: str, now_s: float) -> list[float]:
        view = state.prepare(
            request_id=str(now_s), prefix_hashes=hashes, block_tokens=tokens, prompt_tokens=2048,
            workers=workers, now_s=now_s,
        )  # fmt: skip
        expected = state.hit_expectation(view, worker)
        state.commit(view, Decision(worker, "test"), now_s)
        return expected

    routed((1, 2, 3, 4), "w0", 1.0)
    routed((11, 12, 13, 14), "w0", 2.0)
    routed((21, 22, 23, 24), "w0", 3.0)
    # w0 restarts; a request expecting (11..14) is routed there, then one for a new prefix
    expected = routed((11, 12, 13, 14), "w0", 4.0)
    assert expected == [2.0, 2.0, 2.0, 2.0]
    routed((31, 32, 33, 34), "w0", 5.0)
    stale = state.hit_feedback("w0", expected, cached_tokens=0, block_tokens=tokens)
    assert stale is not None
    before, dropped = stale
    assert before == 2.0 and sorted(dropped) == [1, 2, 3, 4]  # older than the missed root's last touch
    held = state.index.match
    assert held((11, 12, 13, 14)) == {"w0": 4}  # its own prefill cached it again (touched at 4.0)
    assert held((31, 32, 33, 34)) == {"w0": 4}  # routed since: kept
    assert held((21, 22, 23, 24)) == {"w0": 4}  # newer than the evidence: kept until a miss says so
    assert state.hit_feedback("w0", expected, cached_tokens=2048, block_tokens=tokens) is None


def test_no_expectation_for_an_exact_worker() -> None:
    index = PrefixIndex(1000)
    index.set_kind("w0", "exact")
    index.insert("w0", [1, 2, 3], 0.0)
    state = RoutingState(RoutingConfig(policy="kvgate"), index)
    view = state.prepare(
        request_id="r", prefix_hashes=(1, 2, 3), block_tokens=(16, 16, 16), prompt_tokens=48,
        workers=[view_of("w0")], now_s=1.0,
    )  # fmt: skip
    assert view.prefix_hits == {"w0": 3}
    assert state.hit_expectation(view, "w0") == []
