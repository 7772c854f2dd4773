"""bench/exact_demo.py: the paired TTFT delta from two modes' decision logs."""

from __future__ import annotations

import json
from pathlib import Path

from bench.exact_demo import paired_ttft_delta


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
