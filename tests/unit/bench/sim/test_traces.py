"""Mooncake JSONL parsing: block token counts, arrival times, and file:line errors for bad lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim.traces import TraceError, block_token_counts, load_trace

CONVERSATION = Path("/work/shared/traces/mooncake_fast25/conversation_trace.jsonl")


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def line(ts: int = 0, inp: int = 1000, out: int = 10, ids: list[int] | None = None) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids or [0, 1]})


@pytest.mark.parametrize(
    ("input_tokens", "n_blocks", "expected"),
    [
        pytest.param(1000, 2, (512, 488), id="partial last block"),
        pytest.param(1024, 2, (512, 512), id="exact multiple"),
        pytest.param(5, 1, (5,), id="single short block"),
        pytest.param(0, 0, (), id="empty"),
    ],
)
def test_block_token_counts(input_tokens: int, n_blocks: int, expected: tuple[int, ...]) -> None:
    assert block_token_counts(input_tokens, n_blocks) == expected


def test_parses_requests_in_order_with_relative_arrivals(tmp_path: Path) -> None:
    path = write(tmp_path, [line(ts=1500, ids=[0, 1]), "", line(ts=4000, inp=600, out=3, ids=[0, 7])])
    reqs = load_trace(path)
    assert [r.id for r in reqs] == [0, 1]
    assert [r.arrival_s for r in reqs] == [0.0, 2.5]
    assert reqs[1].block_ids == (0, 7)
    assert reqs[1].block_tokens == (512, 88)
    assert reqs[1].output_tokens == 3


def test_limit_keeps_the_first_requests(tmp_path: Path) -> None:
    path = write(tmp_path, [line(ts=i) for i in range(5)])
    assert [r.id for r in load_trace(path, limit=3)] == [0, 1, 2]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        pytest.param("{not json", "not valid JSON", id="broken json"),
        pytest.param("[1, 2]", "expected a JSON object", id="not an object"),
        pytest.param(line(inp=1000, ids=[0]), r"expected ceil\(1000/512\) = 2", id="hash_ids count mismatch"),
        pytest.param(line(out=0), "'output_length' must be >= 1", id="zero output"),
        pytest.param(
            json.dumps({"timestamp": 0, "input_length": "9", "output_length": 1, "hash_ids": [0]}),
            "'input_length' must be an integer",
            id="string length",
        ),
        pytest.param(
            json.dumps({"timestamp": -1, "input_length": 9, "output_length": 1, "hash_ids": [0]}),
            "'timestamp' must be a number",
            id="negative timestamp",
        ),
        pytest.param(
            json.dumps({"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": ["a"]}),
            "'hash_ids' must be a list of integers",
            id="non-integer ids",
        ),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = write(tmp_path, [line(), bad])
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert f"{path}:2:" in str(info.value)


def test_missing_file_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open trace"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path, [""]))


@pytest.mark.skipif(not CONVERSATION.exists(), reason="shared traces not mounted")
def test_real_conversation_trace_matches_published_stats() -> None:
    reqs = load_trace(CONVERSATION)
    assert len(reqs) == 12031
    mean_input = sum(r.input_tokens for r in reqs) / len(reqs)
    assert round(mean_input) == 12035  # PEERS.md §5
    assert all(sum(r.block_tokens) == r.input_tokens for r in reqs)
