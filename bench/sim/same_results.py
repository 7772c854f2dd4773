"""Whether two `kvgate bench sim` results.json (or two grid.json) files hold the same routing results
(wall times aside; a grid's `meta`, how it was run: file path, cached runs, jobs, is not compared).

    python -m bench.sim.same_results BEFORE/results.json AFTER/results.json
    python -m bench.sim.same_results BEFORE/grid.json AFTER/grid.json

Prints `identical` (exit 0) or the first differing fields (exit 1). Used to check that a refactor
leaves the simulator's decisions bit-identical.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TIMING_KEYS = frozenset({"wall_s"})


def without_timing(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timing(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [without_timing(v) for v in value]
    return value


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def results_of(document: Any) -> Any:
    """The document without timing, and a grid's without its `meta`."""
    if isinstance(document, dict) and "cells" in document:
        document = {k: v for k, v in document.items() if k != "meta"}
    return without_timing(document)


def main(argv: list[str] | None = None) -> int:
    before, after = (json.loads(Path(p).read_text()) for p in (argv or sys.argv[1:])[:2])
    found = differences(results_of(before), results_of(after))
    runs = sum(len(c.get("runs", [])) for c in before.get("cells", [])) if isinstance(before, dict) else 0
    print(("identical" + (f" ({runs} runs)" if runs else "")) if not found else "\n".join(found[:20]))
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
