"""`kvgate bench fuzz --seconds N`: coverage-guided fuzzing (atheris/libFuzzer) of the intake.

Runs plugin/fuzz_target.py's `intake_outcome` on inputs libFuzzer mutates (path choice, headers,
raw body, seeded with valid OpenAI requests) for a bounded time in a child process; any exception
(what would be a 500) or a non-4xx refusal is a crash: the input is saved as crash-* in --out and
the command exits 1. Prints the number of inputs run and libFuzzer's final coverage line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/other"]
HEADERS = [b"x-request-id", b"x-kvgate-priority", b"x-kvgate-max-wait-ms", b"x-kvgate-ttft-slo-ms",
           b"authorization", b"x-other"]  # fmt: skip
SEEDS = [
    {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 8},
    {"model": "m", "prompt": ["a", "b"], "max_tokens": 4},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
     "stream_options": {"include_usage": True}},
]  # fmt: skip


def one_input(data: bytes) -> None:
    import atheris  # type: ignore[import-not-found]

    from plugin.fuzz_target import intake_outcome

    fdp = atheris.FuzzedDataProvider(data)
    path = PATHS[fdp.ConsumeIntInRange(0, len(PATHS) - 1)]
    headers = [
        (HEADERS[fdp.ConsumeIntInRange(0, len(HEADERS) - 1)], fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)))
        for _ in range(fdp.ConsumeIntInRange(0, 4))
    ]
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    intake_outcome(path, headers, body)


def child(seconds: int, corpus: str) -> None:
    import atheris

    with atheris.instrument_imports():
        import plugin.fuzz_target
        import plugin.parse  # noqa: F401
    atheris.Setup([sys.argv[0], f"-max_total_time={seconds}", "-print_final_stats=1", corpus], one_input)
    atheris.Fuzz()  # libFuzzer exits the process when the time is up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=60, help="fuzzing time (default 60)")
    parser.add_argument("--out", default="", help="directory for the corpus and crash files (default: temp)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="kvgate-fuzz-"))
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(SEEDS):
        (corpus / f"seed{i}").write_bytes(b"\x00\x00" + json.dumps(seed).encode())
    code = f"import bench.fuzz as f; f.child({args.seconds}, {str(corpus)!r})"
    result = subprocess.run([sys.executable, "-c", code], cwd=out, capture_output=True, text=True)
    log = result.stdout + result.stderr
    runs = next((line for line in log.splitlines() if line.startswith("stat::number_of_executed_units")), "")
    cov = next((line for line in log.splitlines() if "cov:" in line and "DONE" in line), "")
    print(f"kvgate bench fuzz: {args.seconds} s, {runs.split(':')[-1].strip() or '?'} inputs, "
          f"{cov.strip() or 'no final stats'}, exit {result.returncode}")  # fmt: skip
    if result.returncode != 0:
        print(log[-4000:], file=sys.stderr)
        print(f"crash inputs in {out}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
