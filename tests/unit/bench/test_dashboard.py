"""The shipped Grafana dashboards are exactly what bench/dashboard.py generates, and well formed.
(tests/e2e/test_dashboard.py evaluates every query against a real Prometheus.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from bench.dashboard import ROOT, SHIPPED, build, main, queries, render

CORE_VIEWS = ("hit rate", "time to first token", "utilization spread", "throughput", "queue wait")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_copy_equals_the_generated_dashboard(path: Path) -> None:
    assert path.read_text() == render(), f"{path} is stale: run python -m bench.dashboard"


def test_check_mode_reports_a_stale_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "kvgate.json"
    stale.write_text("{}\n")
    monkeypatch.setattr("bench.dashboard.SHIPPED", (stale,))
    monkeypatch.setattr("bench.dashboard.ROOT", tmp_path)
    assert main(["--check"]) == 1
    assert main([]) == 0 and stale.read_text() == render()
    assert main(["--check"]) == 0


def test_core_views_and_the_extra_views_are_there() -> None:
    titles = [p["title"].lower() for p in build()["panels"]]  # type: ignore[index]
    for view in (*CORE_VIEWS, "routing decisions", "hit share per worker", "rejections", "outcomes"):
        assert any(view in t for t in titles), f"no panel for {view!r}: {titles}"


def test_panels_have_unique_ids_a_datasource_and_queries_on_kvgate_metrics() -> None:
    board = build()
    panels = board["panels"]  # type: ignore[index]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in board["templating"]["list"]}  # type: ignore[index]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["model"]["allValue"] == ".*"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
    for title, expr in queries(board):
        assert re.search(r"\bkvgate_[a-z_]+", expr), (title, expr)
        assert expr.count("(") == expr.count(")"), (title, expr)
        # gateway metrics are filtered by the $model variable; the agents' carry no model label
        if "kvgate_agent_" not in expr:
            assert 'model=~"$model"' in expr, (title, expr)


def test_the_dev_extra_installs_the_same_builder_pin() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["dashboard"]) <= set(extras["dev"])
