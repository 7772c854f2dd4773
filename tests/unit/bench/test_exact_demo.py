"""bench/exact_demo.py: the paired TTFT delta from two modes' decision logs, and the paired run's schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.exact_demo import client_paired, interleave, labels, paired_segments, paired_ttft_delta
from bench.loadgen import LiveRequest, LiveResult


def _log(path: Path, ttfts: dict[str, float]) -> None:
    lines = [json.dumps({"client_request_id": k, "ttft_ms": v}) for k, v in ttfts.items()]
    lines.append(json.dumps({"client_request_id": "refused"}))  # no TTFT: not paired
    path.write_text("\n".join(lines) + "\n")


def test_requests_pair_by_their_id_and_the_median_difference_is_reported(tmp_path: Path) -> None:
    # records are written as requests finish, in another order in each mode; one request only in one
    _log(tmp_path / "decisions-approximate.jsonl", {"demo-0": 10.0, "demo-1": 20.0, "demo-2": 30.0})
    _log(tmp_path / "decisions-exact.jsonl", {"demo-2": 31.0, "demo-0": 15.0, "demo-1": 22.0, "demo-3": 99.0})
    assert paired_ttft_delta(tmp_path, "exact") == (2.0, 3)
    assert paired_ttft_delta(tmp_path, "approximate+events") is None


def _record(rid: str, ttft: float, gateway: float, headers: float, **stage_us: float) -> str:
    return json.dumps(
        {"client_request_id": rid, "ttft_ms": ttft, "gateway_ms": gateway, "headers_ms": headers,
         "stage_us": stage_us}
    )  # fmt: skip


def test_the_time_split_pairs_each_segment_and_a_stage_one_side_lacks_gets_its_own_median(
    tmp_path: Path,
) -> None:
    (tmp_path / "decisions-approximate.jsonl").write_text(
        _record("a", 30.0, 1.0, 10.0, route=100.0) + "\n" + _record("b", 40.0, 2.0, 20.0, route=300.0) + "\n"
    )
    (tmp_path / "decisions-exact.jsonl").write_text(
        _record("b", 43.0, 4.0, 21.0, route=400.0, tokenize=900.0)
        + "\n"
        + _record("a", 31.0, 2.0, 10.0, route=200.0, tokenize=700.0)
        + "\n"
    )
    split = paired_segments(tmp_path, "exact", "approximate")
    assert split["ttft"] == (35.0, 37.0, 2.0)
    assert split["arrival → sent"] == (1.5, 3.0, 1.5)
    assert split["sent → worker headers"] == (13.5, 12.5, -1.0)  # (9, 18) against (8, 17)
    assert split["headers → first token"] == (20.0, 21.5, 1.5)
    assert split["stage route"] == pytest.approx((0.2, 0.3, 0.1))
    assert split["stage tokenize"] == pytest.approx((0.0, 0.8, 0.8))
    assert paired_segments(tmp_path, "approximate+events", "approximate") == {}


def test_a_repeated_mode_gets_its_own_name() -> None:
    assert labels(["approximate", "exact"]) == ["approximate", "exact"]
    assert labels(["approximate", "approximate", "approximate+events", "approximate"]) == [
        "approximate",
        "approximate-2",
        "approximate+events",
        "approximate-3",
    ]


def test_the_paired_schedule_sends_each_request_to_every_side_and_the_sides_take_turns_first() -> None:
    requests = [LiveRequest(send_at_s=t, body={"i": i}) for i, t in enumerate([0.1, 0.3, 0.35])]
    a, b = interleave(requests, 2, 0.05)
    assert [q.body for q in a] == [q.body for q in b] == [q.body for q in requests]
    assert [q.send_at_s for q in a] == pytest.approx([0.1, 0.35, 0.35])
    assert [q.send_at_s for q in b] == pytest.approx([0.15, 0.3, 0.4])
    three = interleave(requests, 3, 0.01)  # each side first once, second once, third once
    assert sorted(round(side[0].send_at_s - 0.1, 3) for side in three) == [0.0, 0.01, 0.02]
    assert [round(three[s][1].send_at_s - 0.3, 3) for s in range(3)] == [0.01, 0.02, 0.0]


def test_the_client_paired_delta_is_the_median_over_the_requests_both_sides_served() -> None:
    def result(i: int, ttft: float | None, status: int = 200) -> LiveResult:
        return LiveResult(index=i, status=status, ttft_s=ttft)

    base = [result(0, 0.010), result(1, 0.020), result(2, 0.030), result(3, 0.5)]
    ours = [result(0, 0.012), result(1, 0.021), result(2, 0.034), result(3, None, 503)]
    delta = client_paired(ours, base)
    assert delta is not None
    assert round(delta[0], 6) == 2.0
    assert delta[1] == 3
    assert client_paired([result(0, None, 503)], [result(0, 0.01)]) is None


def test_the_hits_only_delta_leaves_out_a_request_that_missed_on_either_side() -> None:
    def result(i: int, ttft: float, cached: int) -> LiveResult:
        return LiveResult(index=i, status=200, ttft_s=ttft, prompt_tokens=100, cached_tokens=cached)

    base = [result(0, 0.010, 96), result(1, 0.200, 0), result(2, 0.030, 96)]
    ours = [result(0, 0.011, 96), result(1, 0.020, 96), result(2, 0.033, 96)]
    assert client_paired(ours, base) == pytest.approx((1.0, 3))
    assert client_paired(ours, base, hits_only=True) == pytest.approx((2.0, 2))
