"""aiperf 0.13 as the client of `kvgate bench live` (`--client aiperf`): fixed-schedule replay of the
very requests the project's own client sends.

Each run's requests are written as an aiperf `single_turn` dataset: one line per request with its
prompt text, its send time (`timestamp`, ms), its `output_length` and the rest of the body as
`extra` (`ignore_eos`), and aiperf replays it with `--fixed-schedule`, streaming, against the
router's URL(s) (`--url` per gateway, round robin, for kvgate_x2). Its tokenizer is a local
directory (`--tokenizer DIR`, the byte-level BPE bench/toy_model.py trains offline): aiperf accepts a
path, so nothing is downloaded. Only its token counts use it; TTFT and latency do not. Do not set
HF_HUB_OFFLINE: aiperf 0.13 then looks a path up as a Hub repo id and fails (HFValidationError).
aiperf runs in its own virtualenv (bench/live_routers.py builds it like a peer's). Per-request
records (profile_export.jsonl) become `LiveResult`s, so the table, JSON and plots are the same.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.loadgen import LiveRequest, LiveResult

AIPERF_VENV = "aiperf"


def write_dataset(requests: Sequence[LiveRequest], path: Path) -> Path:
    with path.open("w") as out:
        for r in requests:
            body = dict(r.body)
            messages = body.pop("messages")
            line: dict[str, Any] = {
                "text": messages[-1]["content"],  # type: ignore[index]
                "timestamp": round(r.send_at_s * 1000, 3),
                "output_length": body.pop("max_tokens"),
            }
            body.pop("model", None)
            body.pop("stream", None)
            if body:
                line["extra"] = body
            out.write(json.dumps(line) + "\n")
    return path


def command(
    aiperf: Path, urls: Sequence[str], model: str, dataset: Path, tokenizer: Path, out: Path
) -> list[str]:
    args = [str(aiperf), "profile", "--model", model, "--endpoint-type", "chat", "--streaming",
            "--input-file", str(dataset), "--custom-dataset-type", "single_turn", "--fixed-schedule",
            "--tokenizer", str(tokenizer), "--artifact-dir", str(out), "--ui-type", "none",
            "--export-level", "records", "--random-seed", "1"]  # fmt: skip
    for url in urls:
        args += ["--url", url]
    return args


def results(records_path: Path) -> tuple[list[LiveResult], float]:
    """One `LiveResult` per aiperf record (in send order) and the span from first send to last end (s)."""
    records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    records.sort(key=lambda r: r["metadata"].get("request_start_ns", 0))
    out = []
    for i, rec in enumerate(records):
        m = rec.get("metrics") or {}

        def value(name: str, m: dict[str, Any] = m) -> float | None:
            item = m.get(name)
            return None if item is None else float(item["value"])

        error = rec.get("error")
        result = LiveResult(index=i, status=int((error or {}).get("code") or 500) if error else 200)
        if error:
            result.error = str(error)[:500]
        ttft, e2e = value("time_to_first_token"), value("request_latency")
        result.ttft_s = None if ttft is None else ttft / 1000
        result.e2e_s = None if e2e is None else e2e / 1000
        result.prompt_tokens = int(value("usage_prompt_tokens") or 0)
        result.cached_tokens = int(value("usage_prompt_cache_read_tokens") or 0)
        result.output_tokens = int(value("usage_completion_tokens") or 0)
        out.append(result)
    starts = [r["metadata"]["request_start_ns"] for r in records if "request_start_ns" in r["metadata"]]
    ends = [r["metadata"]["request_end_ns"] for r in records if "request_end_ns" in r["metadata"]]
    span = (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0
    return out, span


def run_aiperf(
    venv: Path,
    urls: Sequence[str],
    model: str,
    requests: Sequence[LiveRequest],
    tokenizer: Path,
    work_dir: Path,
) -> tuple[list[LiveResult], float]:
    """Replay `requests` through aiperf against `urls`; (results, seconds from first send to last end)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    dataset = write_dataset(requests, work_dir / "aiperf-dataset.jsonl")
    out = work_dir / "aiperf"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with (work_dir / "aiperf.log").open("wb") as log:
        subprocess.run(
            command(venv / "bin" / "aiperf", urls, model, dataset, tokenizer, out),
            stdout=log, stderr=subprocess.STDOUT, env=env, check=True, timeout=3600,
        )  # fmt: skip
    return results(out / "profile_export.jsonl")
