"""Opt-in allocation tracing, to find what grows in a long-running gateway.

    KVGATE_TRACEMALLOC=30 kvgate proxy ...

With the variable set to N seconds, the gateway starts `tracemalloc` (10 frames) and a thread that,
every N seconds, logs the 10 source lines whose live allocations grew most since the first snapshot
(taken after one period, past the start-up allocations) and the traced total. Tracing slows every
allocation: a diagnosis tool, never for production load figures.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import tracemalloc

log = logging.getLogger("kvgate.memtrace")

ENV = "KVGATE_TRACEMALLOC"


def start_from_env() -> bool:
    value = os.environ.get(ENV, "")
    if not value:
        return False
    period_s = float(value)
    tracemalloc.start(10)
    threading.Thread(target=_watch, args=(period_s,), name="kvgate-memtrace", daemon=True).start()
    return True


def _watch(period_s: float) -> None:
    time.sleep(period_s)
    base = tracemalloc.take_snapshot()
    while True:
        time.sleep(period_s)
        snap = tracemalloc.take_snapshot()
        current, _peak = tracemalloc.get_traced_memory()
        top = snap.compare_to(base, "lineno")[:10]
        lines = [f"{s.size_diff / 1024:+9.1f} KiB {s.count_diff:+7d} blocks  {s.traceback[0]}" for s in top]
        log.warning(
            "memtrace: traced %.1f MiB; growth since the first snapshot:\n%s",
            current / 2**20,
            "\n".join(lines),
        )
