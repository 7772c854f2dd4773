"""`kvgate bench tokenize` runs end to end on a small prompt and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

from bench.tokenize_bench import main


def test_writes_the_interface_keys(tmp_path: Path) -> None:
    out = tmp_path / "tok.json"
    args = ["--json", str(out), "--prefix-tokens", "1500", "--prompt-tokens", "2000", "--rounds", "3"]
    assert main([*args, "--cold-rounds", "1"]) == 0
    figures = json.loads(out.read_text())
    assert {"prompt_tokens", "cached_prefix_tokens", "p50", "p99", "loop_stall_p99"} <= set(figures)
    assert figures["cached_prefix_tokens"] >= 1400 and figures["prompt_tokens"] >= 2000
    assert 0 < figures["p50"] <= figures["p99"]
