"""helm/kvgate checked structurally (test_render.py renders it with Helm's engine): the plain YAML
files parse, Chart.yaml has its fields, templates use only values that values.yaml defines and close
every block they open, the config in values.yaml is a valid gateway config, and the autoscaling
examples query metrics the gateway really exports."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from plugin.config import load_config
from plugin.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "kvgate"
TEMPLATES = sorted((CHART / "templates").glob("*"))
PLAIN_YAML = [
    CHART / "Chart.yaml", CHART / "values.yaml", *sorted((CHART / "examples").glob("*.yaml")),
    *sorted((CHART / "ci").glob("*.yaml")),
    ROOT / "examples" / "keda-scaledobject.yaml", ROOT / "examples" / "hpa.yaml",
]  # fmt: skip


def load_all(path: Path) -> list[Any]:
    return [doc for doc in YAML(typ="safe").load_all(path.read_text()) if doc is not None]


def values() -> dict[str, Any]:
    [doc] = load_all(CHART / "values.yaml")
    return doc


@pytest.mark.parametrize("path", PLAIN_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_plain_yaml_parses(path: Path) -> None:
    assert load_all(path), f"{path} has no document"


def test_chart_yaml_has_the_required_fields() -> None:
    [chart] = load_all(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "kvgate" == CHART.name
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    for field in ("appVersion", "description", "type"):
        assert chart.get(field), field


def has_path(tree: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_templates_reference_only_defined_values(template: Path) -> None:
    refs = re.findall(r"\.Values\.([A-Za-z0-9_.]+)", template.read_text())
    missing = [ref for ref in refs if not has_path(values(), ref.rstrip("."))]
    assert not missing, f"{template.name} reads values that values.yaml does not define: {missing}"


def test_every_value_is_read_by_some_template() -> None:
    text = "".join(t.read_text() for t in TEMPLATES)
    leaves = []

    def walk(tree: Any, prefix: str) -> None:
        for key, sub in tree.items():
            path = f"{prefix}{key}"
            if (
                isinstance(sub, dict)
                and sub
                and f".Values.{path} " not in text
                and f".Values.{path} |" not in text
            ):
                walk(sub, path + ".")
            else:
                leaves.append(path)

    walk(values(), "")
    unused = [p for p in leaves if f".Values.{p}" not in text]
    assert not unused, f"values nobody reads: {unused}"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_template_blocks_are_balanced(template: Path) -> None:
    actions = re.findall(r"{{-?\s*(if|with|range|define|end)\b", template.read_text())
    depth = 0
    for action in actions:
        depth += -1 if action == "end" else 1
        assert depth >= 0, f"{template.name}: `end` without an open block"
    assert depth == 0, f"{template.name}: {depth} block(s) not closed"


def test_values_config_is_a_valid_gateway_config(tmp_path: Path) -> None:
    config_file = tmp_path / "kvgate.toml"
    config_file.write_text(values()["config"])
    config = load_config(config_file)
    grace_s = values()["gateway"]["terminationGracePeriodSeconds"]
    assert grace_s > config.gateway.drain_timeout_ms / 1000, "pods would be killed mid-drain"
    assert tomllib.loads(values()["config"])["admission"]["audit_every_ms"] > 0


def test_gateway_pod_gets_one_core_and_probes_healthz() -> None:
    gateway = values()["gateway"]
    assert gateway["resources"]["requests"]["cpu"] == gateway["resources"]["limits"]["cpu"] == "1"
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    assert deployment.count("path: /healthz") == 1  # liveness: the process answers
    assert deployment.count("path: /readyz") == 1  # readiness: Redis, a routable worker, not draining
    assert "emptyDir" in deployment and "--confdir=" in deployment


METRIC_FILES = [ROOT / "examples" / "keda-scaledobject.yaml", ROOT / "examples" / "hpa.yaml",
                CHART / "templates" / "scaledobject.yaml"]  # fmt: skip


@pytest.mark.parametrize("path", METRIC_FILES, ids=lambda p: p.name)
def test_autoscaling_uses_exported_metrics_and_not_gpu_utilization(path: Path) -> None:
    exported = {m.name for m in GatewayMetrics().all()}
    used = set(re.findall(r"\bkvgate_[a-z_]+", path.read_text()))
    assert "kvgate_expected_queue_wait_seconds" in used
    assert used <= exported, f"{path.name} queries metrics the gateway does not export: {used - exported}"
    queries = re.findall(r"query: (.*)", path.read_text(), flags=re.IGNORECASE)
    assert queries and not [q for q in queries if "gpu" in q.lower() or "dcgm" in q.lower()]
