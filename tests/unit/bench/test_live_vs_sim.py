"""bench.live_vs_sim: the client's send delay on a replay, and the goodput range of the live passes."""

from __future__ import annotations

import pytest

from bench.hit_value import delayed
from bench.live_vs_sim import live_means
from bench.sim.types import SimRequest


def _requests(n: int) -> list[SimRequest]:
    return [
        SimRequest(
            id=i, arrival_s=0.001 * i, input_tokens=16, output_tokens=1, block_ids=(i,), block_tokens=(16,)
        )
        for i in range(n)
    ]


def test_no_delay_replays_the_trace_as_written() -> None:
    reqs = _requests(5)
    assert delayed(reqs, 0.0, 7) == reqs


def test_each_arrival_is_delayed_by_at_most_the_jitter_and_the_replay_stays_in_arrival_order() -> None:
    reqs = _requests(200)
    out = delayed(reqs, 0.010, 3)
    by_id = {r.id: r for r in reqs}
    assert sorted(r.id for r in out) == [r.id for r in reqs]
    assert all(0.0 <= r.arrival_s - by_id[r.id].arrival_s <= 0.010 for r in out)
    assert [r.arrival_s for r in out] == sorted(r.arrival_s for r in out)
    assert [r.id for r in out] != [r.id for r in reqs]  # 1 ms apart, up to 10 ms late: some overtake
    assert delayed(reqs, 0.010, 3) == out  # one seed, one replay
    assert delayed(reqs, 0.010, 4) != out


def test_live_means_keep_the_goodput_range_of_the_passes() -> None:
    runs = [
        {"router": "sglang", "ttft_p50": 0.5, "ttft_p99": 2.6, "hit_rate": 0.72, "throughput_rps": 28.5,
         "goodput_rps": 25.9},
        {"router": "sglang", "ttft_p50": 0.6, "ttft_p99": 4.7, "hit_rate": 0.72, "throughput_rps": 23.6,
         "goodput_rps": 19.0},
    ]  # fmt: skip
    got = live_means(runs)["sglang"]
    assert got["goodput_rps"] == pytest.approx(22.45)
    assert (got["goodput_rps_min"], got["goodput_rps_max"]) == (19.0, 25.9)
    assert got["throughput_rps"] == pytest.approx(26.05)
