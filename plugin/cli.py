"""`kvgate` command line: a thin dispatcher to each subcommand's own `main(argv) -> int`.

Subcommand modules are imported only when called, so `kvgate proxy` does not load the simulator.
"""

from __future__ import annotations

import importlib
import sys

from runtime import compat

# command words -> "module:function"; each function takes the remaining argv and returns an exit code
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("proxy",): ("plugin.launcher:main", "run the gateway (mitmdump + kvgate addon) in front of workers"),
    ("demo",): ("bench.demo:main", "embedded Redis + 4 emulated workers + gateway; kvgate vs round-robin"),
    ("drain",): ("plugin.drain:main", "stop routing to a worker and wait for its in-flight requests"),
    ("agent",): ("agent.__main__:main", "node agent beside one worker: lease, load, cache summary"),
    ("worker",): ("bench.emulator.__main__:main", "an emulated vLLM worker"),
    ("bench", "sim"): ("bench.sim.cli:main", "trace-driven simulator: policies side by side"),
    ("bench", "overhead"): ("bench.overhead:main", "gateway overhead against bare mitmdump and direct"),
    ("bench", "burst"): ("bench.burst:main", "live 2x burst through two gateways sharing one Redis"),
    ("bench", "chaos"): ("bench.chaos:main", "streaming load through 2 gateways while faults are injected"),
    ("bench", "fuzz"): ("bench.fuzz:main", "atheris fuzzing of the request intake for a bounded time"),
    ("bench", "tokenize"): (
        "bench.tokenize_bench:main",
        "exact mode: local tokenizer cost and event-loop stall",
    ),
    ("bench", "index-size"): ("bench.index_size:main", "index bytes in Redis, Bloom false-positive cost"),
    ("bench", "live"): ("bench.live:main", "kvgate and the real peer routers on the same emulated workers"),
    ("bench", "scale"): ("bench.scale:main", "decision time vs workers and index, Redis cost, processes"),
    ("explain",): (
        "plugin.explain:main",
        "why a request went where it did (or was refused), or a worker's traffic",
    ),
    ("top",): ("plugin.top:main", "live terminal view: workers, queues, quotas, last decisions"),
    ("bench", "replay"): ("bench.replay:main", "re-run a recorded decision log through the simulator"),
    ("bench", "ab"): ("bench.ab:main", "A/B split on a live demo stack: both arms' core metrics"),
}


def usage() -> str:
    lines = ["usage: kvgate COMMAND [ARGS...]", "", "commands:"]
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<16} {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    compat.install()  # every subcommand runs with the process-wide fixes (runtime/)
    args = list(sys.argv[1:] if argv is None else argv)
    for words, (target, _) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(args[: len(words)]) == words:
            module_name, func_name = target.split(":")
            func = getattr(importlib.import_module(module_name), func_name)
            return int(func(args[len(words) :]) or 0)
    print(usage(), file=sys.stderr)
    return 0 if args[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
