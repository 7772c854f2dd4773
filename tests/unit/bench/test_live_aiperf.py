"""The aiperf client's dataset (single_turn, fixed schedule) and its per-request records as LiveResults."""

from __future__ import annotations

import json
from pathlib import Path

from bench.live_aiperf import command, results, write_dataset
from bench.loadgen import LiveRequest


def test_each_request_becomes_one_timed_single_turn_line(tmp_path: Path) -> None:
    reqs = [
        LiveRequest(0.0, {"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": 5,
                          "ignore_eos": True}),
        LiveRequest(1.25, {"model": "m", "messages": [{"role": "user", "content": "b"}], "max_tokens": 7}),
    ]  # fmt: skip
    lines = [json.loads(x) for x in write_dataset(reqs, tmp_path / "d.jsonl").read_text().splitlines()]
    assert lines == [
        {"text": "a", "timestamp": 0.0, "output_length": 5, "extra": {"ignore_eos": True}},
        {"text": "b", "timestamp": 1250.0, "output_length": 7},
    ]
    args = command(
        Path("aiperf"), ["http://a", "http://b"], "m", tmp_path / "d.jsonl", tmp_path / "tok", tmp_path
    )
    assert "--fixed-schedule" in args and args.count("--url") == 2 and "single_turn" in args


def test_records_become_results_in_send_order(tmp_path: Path) -> None:
    def record(start: int, end: int, ttft_ms: float | None, error: dict[str, object] | None = None) -> str:
        metrics = {"request_latency": {"value": 40.0, "unit": "ms"},
                   "usage_prompt_tokens": {"value": 100, "unit": "tokens"},
                   "usage_prompt_cache_read_tokens": {"value": 64, "unit": "tokens"}}  # fmt: skip
        if ttft_ms is not None:
            metrics["time_to_first_token"] = {"value": ttft_ms, "unit": "ms"}
        rec: dict[str, object] = {
            "metadata": {"request_start_ns": start, "request_end_ns": end},
            "metrics": metrics,
        }
        if error:
            rec["error"] = error
        return json.dumps(rec)

    path = tmp_path / "profile_export.jsonl"
    path.write_text("\n".join([record(2_000_000_000, 3_500_000_000, None, {"code": 503, "message": "busy"}),
                               record(1_000_000_000, 1_040_000_000, 12.5)]))  # fmt: skip
    got, span = results(path)
    assert [(r.ok, r.status, r.ttft_s, r.cached_tokens) for r in got] == [
        (True, 200, 0.0125, 64),
        (False, 503, None, 64),
    ]
    assert span == 2.5
