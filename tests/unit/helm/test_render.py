"""helm/kvgate rendered offline by Helm's own engine (helm-python-sdk bundles Helm v4's Go SDK as a C
library: no helm binary, no cluster) with every values file under ci/, and every manifest validated
strictly: core kinds against the Kubernetes OpenAPI schemas (kubernetes-validate, unknown fields are
errors), the CRD kinds (ServiceMonitor, ScaledObject) against the upstream CRDs' own schemas in
crds/ made strict the same way. Then what the manifests mean: API keys only in the Secret, the
assembled config is a valid gateway config, the gateway runs the same addon and options as the e2e
tests, the agent sidecar's arguments parse and match vLLM's --kv-events-config."""

from __future__ import annotations

import json
import shlex
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
from ruamel.yaml import YAML

from agent.config import parse_args as parse_agent_args
from plugin.config import config_from_dict
from plugin.launcher import build_parser, mitmdump_args
from tests.e2e.harness import Gateway

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "kvgate"
VALUES_FILES = sorted((CHART / "ci").glob("*.yaml"))
CRDS = Path(__file__).parent / "crds"
# the oldest Kubernetes the chart supports and the newest kubernetes-validate knows
K8S_VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version())

Manifest = dict[str, Any]


def load_yaml(text: str) -> list[Any]:
    return [doc for doc in YAML(typ="safe").load_all(text) if doc is not None]


@cache
def rendered(values_file: Path) -> tuple[Manifest, ...]:
    [values] = load_yaml(values_file.read_text()) or [{}]
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        files = chart.render(values, name="demo", namespace="prod", is_install=True)
    return tuple(doc for text in files.values() for doc in load_yaml(text))


def values_of(values_file: Path) -> dict[str, Any]:
    """The values the chart renders with: its defaults under the file's."""
    [overrides] = load_yaml(values_file.read_text()) or [{}]
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(overrides or {})


def of_kind(manifests: tuple[Manifest, ...], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def named(manifests: tuple[Manifest, ...], kind: str, name: str) -> Manifest:
    [found] = [m for m in of_kind(manifests, kind) if m["metadata"]["name"] == name]
    return found


def containers(deployment: Manifest) -> dict[str, Manifest]:
    spec = deployment["spec"]["template"]["spec"]
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


ids = [p.name for p in VALUES_FILES]


def test_there_are_values_files_for_the_main_setups() -> None:
    assert {"default-values.yaml", "full-values.yaml", "external-redis-values.yaml"} <= set(ids)


# -- strict schema validation ------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """The schema with unknown properties refused wherever it lists properties (kubernetes-validate's
    --strict does the same to the core schemas), except where the CRD keeps unknown fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        lists_fields = "properties" in out and "additionalProperties" not in out
        if lists_fields and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], Any]:
    out = {}
    for path in CRDS.glob("*.yaml"):
        for crd in load_yaml(path.read_text()):
            for version in crd["spec"]["versions"]:
                api_version = f"{crd['spec']['group']}/{version['name']}"
                out[(api_version, crd["spec"]["names"]["kind"])] = strict(
                    version["schema"]["openAPIV3Schema"]
                )
    return out


def validate(manifest: Manifest, version: str) -> None:
    key = (manifest["apiVersion"], manifest["kind"])
    if key in crd_schemas():
        jsonschema.Draft7Validator(crd_schemas()[key]).validate(manifest)
    else:
        kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_passes_strict_schema_validation(values_file: Path, version: str) -> None:
    manifests = rendered(values_file)
    assert of_kind(manifests, "Deployment") and of_kind(manifests, "Service")
    for manifest in manifests:
        validate(manifest, version)


def test_strict_validation_catches_a_misspelt_field() -> None:
    service = dict(next(m for m in rendered(VALUES_FILES[0]) if m["kind"] == "Service"))
    with pytest.raises(kubernetes_validate.ValidationError):
        validate({**service, "spec": {**service["spec"], "selectr": {}}}, K8S_VERSIONS[-1])
    monitor = next(m for m in rendered(CHART / "ci" / "full-values.yaml") if m["kind"] == "ServiceMonitor")
    with pytest.raises(jsonschema.ValidationError):
        validate({**monitor, "spec": {**monitor["spec"], "endpoint": []}}, K8S_VERSIONS[-1])


def test_values_schema_refuses_unknown_keys_and_wrong_types() -> None:
    with helm.Chart.load(CHART) as chart:
        for bad in ({"gatway": {}}, {"gateway": {"replicas": "2"}}, {"redis": {"password": "a b@c"}},
                    {"config": '[tenants.x]\napi_keys = ["k"]\n'},
                    {"workers": {"kvEvents": {"config": {"endpoint": "tcp://*:1"}}}},
                    {"hpa": {"enabled": True}, "keda": {"enabled": True}}):  # fmt: skip
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)


# -- what the manifests mean --------------------------------------------------------------------------


def secret_data(manifests: tuple[Manifest, ...]) -> dict[str, str]:
    secrets = of_kind(manifests, "Secret")
    return secrets[0].get("stringData", {}) if secrets else {}


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
def test_api_keys_and_the_redis_password_are_only_in_the_secret(values_file: Path) -> None:
    manifests = rendered(values_file)
    values = values_of(values_file)
    keys = [k for t in values["auth"]["tenants"].values() for k in t["apiKeys"]]
    secrets = [values["redis"]["password"]] if values["redis"]["password"] else []
    not_secret = json.dumps([m for m in manifests if m["kind"] != "Secret"])
    for secret in keys + secrets:
        assert secret not in not_secret
        assert any(secret in v for v in secret_data(manifests).values())


def assembled_config(manifests: tuple[Manifest, ...]) -> str:
    """The config file the init container writes: the ConfigMap's TOML, then the Secret's tenants."""
    gateway = named(manifests, "Deployment", "demo-kvgate")
    [assemble] = containers(gateway)["config"]["command"][2:]
    assert assemble == (
        "cat /etc/kvgate/config/kvgate.toml /etc/kvgate/secret/tenants.toml > /etc/kvgate/run/kvgate.toml"
    )
    configmap = named(manifests, "ConfigMap", "demo-kvgate")
    return configmap["data"]["kvgate.toml"] + secret_data(manifests).get("tenants.toml", "")


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
def test_the_assembled_config_is_a_valid_gateway_config(values_file: Path) -> None:
    manifests = rendered(values_file)
    values = values_of(values_file)
    gateway = named(manifests, "Deployment", "demo-kvgate")
    config = config_from_dict(tomllib.loads(assembled_config(manifests)))
    if not values["auth"]["existingSecret"]:
        assert {k for t in config.tenants.values() for k in t.api_keys} == {
            k for t in values["auth"]["tenants"].values() for k in t["apiKeys"]
        }
    grace_s = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s > config.gateway.drain_timeout_ms / 1000


def sets(argv: list[str]) -> tuple[str, dict[str, list[str]]]:
    """(mode, {option: values}) of the mitmdump command `kvgate proxy ARGV` runs."""
    out = mitmdump_args(build_parser().parse_args(argv), "/confdir")
    mode = out[out.index("--mode") + 1]
    options: dict[str, list[str]] = {}
    for i, arg in enumerate(out):
        if arg == "--set":
            key, _, value = out[i + 1].partition("=")
            options.setdefault(key, []).append(value)
    return mode, options


def expand(arg: str) -> str:
    return arg.replace("$(POD_NAME)", "demo-kvgate-0").replace("$(REDIS_PASSWORD)", "pw")


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
def test_the_gateway_runs_the_same_addon_and_options_as_the_e2e_tests(
    values_file: Path, tmp_path: Path
) -> None:
    manifests = rendered(values_file)
    gateway = containers(named(manifests, "Deployment", "demo-kvgate"))["kvgate"]
    config = tmp_path / "kvgate.toml"  # the file the init container assembles, here on disk
    config.write_text(assembled_config(manifests))
    # the image's entrypoint is `kvgate` (test_dockerfile.py), the console script for plugin.cli:main,
    # which the e2e harness runs as `python -m plugin.cli`: the same `proxy` subcommand
    e2e = Gateway(redis_url="redis://127.0.0.1:1/0", config=config, gateway_id="gw").command()
    assert e2e[:4] == [sys.executable, "-m", "plugin.cli", "proxy"]
    args = [expand(a).replace("/etc/kvgate/run/kvgate.toml", str(config)) for a in gateway["args"]]
    assert args[0] == "proxy"
    chart_mode, chart_sets = sets(args[1:])
    e2e_mode, e2e_sets = sets(e2e[4:])
    assert chart_mode == e2e_mode
    extra = build_parser().parse_args(args[1:]).mitmdump_args
    assert set(chart_sets) - set(e2e_sets) <= {k.split("=")[0] for k in extra if "=" in k}
    assert set(e2e_sets) <= set(chart_sets)
    assert chart_sets["kvgate_config"] == e2e_sets["kvgate_config"] == [str(config)]
    assert chart_sets["kvgate_gateway_id"] == ["demo-kvgate-0"]
    assert chart_sets["kvgate_redis_url"][0].startswith("redis")
    assert "--listen-host=0.0.0.0" in args  # reachable from the Service (the e2e tests use loopback)
    port = next(p["containerPort"] for p in gateway["ports"] if p["name"] == "http")
    assert f"--listen-port={port}" in args


def agent_sidecars(manifests: tuple[Manifest, ...]) -> Iterator[tuple[Manifest, Manifest]]:
    for deployment in of_kind(manifests, "Deployment"):
        found = containers(deployment)
        if "kvgate-agent" in found:
            yield found["vllm"], found["kvgate-agent"]


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=ids)
def test_the_agent_sidecar_parses_and_follows_vllm_kv_events(values_file: Path) -> None:
    values = values_of(values_file)
    sidecars = list(agent_sidecars(rendered(values_file)))
    assert len(sidecars) == (1 if values["workers"]["enabled"] else 0)
    for vllm, agent in sidecars:
        env = {e["name"]: e.get("value", "") for e in agent["env"]}
        assert agent["args"][0] == "agent"
        config = parse_agent_args(
            [expand(a) for a in agent["args"][1:]] + ["--redis", expand(env["KVGATE_REDIS_URL"])]
        )
        assert config.worker_url == f"http://127.0.0.1:{values['workers']['port']}"
        assert config.model == values["workers"]["model"] and config.worker_id == "demo-kvgate-0"
        kv_flags = [a for a in vllm["args"] if a.startswith("--kv-events-config=")]
        if values["workers"]["kvEvents"]["enabled"]:
            [flag] = kv_flags
            kv = json.loads(flag.partition("=")[2])
            assert kv == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
            assert config.kv_events == f"tcp://127.0.0.1:{kv['endpoint'].rsplit(':', 1)[1]}"
        else:
            assert not kv_flags and config.kv_events is None
        drain = shlex.split(agent["lifecycle"]["preStop"]["exec"]["command"][2])
        assert drain[:2] == ["kvgate", "drain"] and "--wait" in drain


def test_full_setup_has_every_object_the_chart_offers() -> None:
    manifests = rendered(CHART / "ci" / "full-values.yaml")
    kinds = {m["kind"] for m in manifests}
    assert {
        "Secret",
        "ConfigMap",
        "ServiceMonitor",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    } <= kinds
    hpa = of_kind(manifests, "HorizontalPodAutoscaler")[0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "vllm-llama"
    metric_names = {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert "kvgate_expected_queue_wait_seconds" in metric_names
    monitors = of_kind(manifests, "ServiceMonitor")
    gateway_service = named(manifests, "Service", "demo-kvgate")
    selected = monitors[0]["spec"]["selector"]["matchLabels"]
    assert selected.items() <= gateway_service["metadata"]["labels"].items()
    assert {e["port"] for e in monitors[0]["spec"]["endpoints"]} <= {
        p["name"] for p in gateway_service["spec"]["ports"]
    }
    dashboard = named(manifests, "ConfigMap", "demo-kvgate-dashboard")
    assert (
        dashboard["data"]["kvgate.json"].strip() == (CHART / "dashboards" / "kvgate.json").read_text().strip()
    )
    pdb = of_kind(manifests, "PodDisruptionBudget")[0]
    gateway = named(manifests, "Deployment", "demo-kvgate")
    assert pdb["spec"]["selector"]["matchLabels"] == gateway["spec"]["selector"]["matchLabels"]


def test_helm_lint_finds_no_errors() -> None:
    report = helm.lint(CHART)
    assert report["errors"] == [], report
    assert not [m for m in report["messages"] if m["severity"] > 1], (
        report
    )  # 1 = info ("icon is recommended")
