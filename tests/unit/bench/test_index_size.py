"""bench/index_size.py: the summary replay on a small synthetic trace (the Redis part runs in the bench)."""

from __future__ import annotations

from bench.index_size import replay


def test_bloom_summaries_cost_little_hit_rate_and_exact_ones_predict_no_phantoms() -> None:
    # 3 shared system prompts of 6 blocks, each followed by a private tail of 4 blocks
    trace = [[p * 100 + b for b in range(6)] + [10_000 + 10 * i + t for t in range(4)] for i, p in
             enumerate([0, 1, 2] * 40)]  # fmt: skip
    exact = replay(trace, workers=3, capacity=60, refresh=1, fp_rate=None)
    loose = replay(trace, workers=3, capacity=60, refresh=1, fp_rate=0.3)
    assert exact["phantom_blocks"] == 0 and exact["hit_rate"] > 0.5  # the shared prompts are found
    assert loose["summary_bytes_per_worker"] < exact["summary_bytes_per_worker"]
    assert loose["hit_rate"] <= exact["hit_rate"] + 1e-9
