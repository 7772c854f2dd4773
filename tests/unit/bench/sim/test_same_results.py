"""bench/sim/same_results.py: wall times are ignored, any other difference is reported."""

from __future__ import annotations

import json
from pathlib import Path

from bench.sim import same_results


def test_only_wall_time_may_differ(tmp_path: Path) -> None:
    run = {"runs": [{"policy": "kvgate", "wall_s": 1.0, "metrics": {"ttft_p99": 0.5}}]}
    other = {"runs": [{"policy": "kvgate", "wall_s": 9.0, "metrics": {"ttft_p99": 0.5}}]}
    changed = {"runs": [{"policy": "kvgate", "wall_s": 1.0, "metrics": {"ttft_p99": 0.6}}]}
    assert_same_then_different(tmp_path, run, other, changed)


def test_a_grid_is_compared_without_how_it_was_run(tmp_path: Path) -> None:
    cells = [{"workload": "rag", "runs": [{"policy": "kvgate", "wall_s": 1.0, "metrics": {"ttft_p99": 0.5}}]}]
    a = {"cells": cells, "summary": {}, "meta": {"grid": "/a/grid.toml", "computed_runs": 1}}
    b = {"cells": cells, "summary": {}, "meta": {"grid": "/b/grid.toml", "computed_runs": 0}}
    changed = {"cells": [{**cells[0], "load": 1.0}], "summary": {}, "meta": a["meta"]}
    assert_same_then_different(tmp_path, a, b, changed)


def assert_same_then_different(tmp_path: Path, base: object, same: object, changed: object) -> None:
    """same_results finds `same` identical to `base` (exit 0) and `changed` different (exit 1)."""
    paths = []
    for name, data in (("a", base), ("b", same), ("c", changed)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    assert same_results.main([str(paths[0]), str(paths[1])]) == 0
    assert same_results.main([str(paths[0]), str(paths[2])]) == 1
