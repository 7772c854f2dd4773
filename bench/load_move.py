"""A real run where a prefix's holder is busier and requests go elsewhere, told by `kvgate explain`
(the load-driven move of docs/OPERATIONS.md).

The demo's stack (bench/ab.py: 4 emulated workers with agents, one gateway writing its decision log)
with proactive replicas off: one request warms a 3,000-token prefix on one worker, then `--burst`
streamed requests of that prefix arrive at once. Prints how many moved away from the cache by load
and the `kvgate explain` story of the first one.

    python -m bench.load_move [--burst 160] [--work /tmp/load_move]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
from pathlib import Path

from bench.ab import start_demo_stack, wait_for_records
from bench.live_scenarios import filler_text
from bench.loadgen import LiveRequest, run_open_loop
from bench.stack import Stack
from plugin.explain import classify

MODEL = "demo-model"


def burst(
    text: str, n: int, max_tokens: int, *, model: str = MODEL, wait_ms: int | None = None
) -> list[LiveRequest]:
    """n streamed requests at once behind one 3k-word system prompt (shared with the ops-tools e2e test)."""
    system = "You are the burst assistant. " + filler_text(random.Random(5), 3000)
    headers = {"x-kvgate-max-wait-ms": str(wait_ms)} if wait_ms is not None else {}
    return [
        LiveRequest(
            send_at_s=0.0,
            body={
                "model": model,
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"{text} {i}"},
                ],
            },
            headers=headers,
        )
        for i in range(n)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load_move", description=__doc__)
    parser.add_argument("--burst", type=int, default=160)
    parser.add_argument("--work", default="/tmp/load_move")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    with Stack(log_dir=work) as stack:
        toml = f'[routing.tuning.replicas]\nproactive = false\n\n[models."{MODEL}"]\ntotal = 256\n'
        gateway, decisions = start_demo_stack(stack, work, MODEL, toml)
        results = asyncio.run(run_open_loop(gateway, burst("warm question", 1, 256)))
        results += asyncio.run(run_open_loop(gateway, burst("hot question", args.burst, 256)))
        records = wait_for_records(decisions, len(results))
        moved = [r for r in records if r.get("worker") and classify(r).kind == "load_move"]
        print(f"{len(moved)} of {len(records)} requests moved away from the cache by load")
        for record in moved[:1]:
            cli = [
                sys.executable,
                "-m",
                "plugin.cli",
                "explain",
                record["request_id"],
                "--file",
                str(decisions),
            ]
            print(subprocess.run(cli, capture_output=True, text=True, check=False).stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
