"""kvgate explain's wording: classification and the plain-words lines, on records of the real shape."""

from __future__ import annotations

from plugin.explain import classify, parse_since, story, worker_summary

BASE = {"request_id": "r1", "model": "m", "tenant": "t", "band": "normal", "arm": "default",
        "policy": "kvgate", "arrival_ms": 1.0e12, "prompt_tokens_est": 100, "prefix_hashes": [1, 2],
        "block_tokens": [64, 36], "index": "approximate", "queued_ms": 0.5, "status": 200,
        "latency_ms": 120.0, "held_by": None, "reroutes": 0, "worker_full": 0}  # fmt: skip


def routed(worker: str, hits: dict[str, int], reason: str = "prefix 1.00 on w0") -> dict[str, object]:
    scores = {w: {"prefix-match": h / 2, "predicted-ttft": 0.1 + i, "cost": 0.1 + i}
              for i, (w, h) in enumerate(hits.items())}  # fmt: skip
    return {**BASE, "worker": worker, "hits": hits, "candidates": scores, "reason": reason,
            "prompt_tokens": 100, "cached_tokens": 64, "ttft_ms": 30.0}  # fmt: skip


def test_classify() -> None:
    assert classify(routed("w0", {"w0": 2, "w1": 1})).kind == "cache_hit"
    assert classify(routed("w1", {"w0": 2, "w1": 0})).kind == "load_move"
    assert (
        classify(routed("w1", {"w0": 2}, "prefix 1.00 on w1, hot prefix: may add a replica")).kind
        == "replicate"
    )
    assert classify(routed("w1", {})).kind == "miss"
    assert classify({**routed("w1", {"w0": 2}), "policy": "round_robin"}).kind == "baseline"


def test_story_of_a_hit_and_of_a_refusal() -> None:
    text = story(routed("w0", {"w0": 2, "w1": 1}))
    assert "a CACHE HIT: it held 2 of the 2 prefix blocks" in text
    assert "reused 64 of 100 prompt tokens" in text and "admitted at once" in text
    refused = {**BASE, "worker": None, "status": 429, "refused_by": "admission", "reason": "queue_full",
               "detail": "queue full", "queued_ms": 3.0}  # fmt: skip
    text = story(refused)
    assert "REFUSED by admission control with HTTP 429: the admission queue" in text
    assert "Retry-After" in text


def test_worker_summary_counts_moves_away() -> None:
    records = [routed("w0", {"w0": 2}), routed("w1", {"w0": 2, "w1": 0}), {**BASE, "worker": None}]
    summary = worker_summary(records, "w0", 300)
    assert summary["to_worker"] == 1 and summary["away_by_load"] == 1 and summary["refused"] == 1
    assert summary["away_to"] == {"w1": 1}


def test_parse_since() -> None:
    assert parse_since("5m") == 300 and parse_since("2h") == 7200 and parse_since("90") == 90
