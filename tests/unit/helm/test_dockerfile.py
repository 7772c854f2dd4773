"""The Dockerfile of the image the chart names, checked statically (no container engine here): it
installs this package, runs `kvgate` as a numeric non-root user, and is tagged as the chart expects."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path

from ruamel.yaml import YAML

from plugin.launcher import build_parser

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def only(word: str) -> str:
    [value] = [rest for w, rest in instructions() if w == word]
    return value


def test_base_image_has_a_python_mitmproxy_12_runs_on() -> None:
    match = re.fullmatch(r"python:3\.(\d+)-slim", only("FROM"))
    assert match and int(match.group(1)) >= 12


def test_it_copies_the_checkout_and_installs_the_package_from_it() -> None:
    copies = [rest.split() for w, rest in instructions() if w == "COPY"]
    assert [".", "/src"] in copies
    runs = " && ".join(rest for w, rest in instructions() if w == "RUN")
    assert re.search(r"pip install (--no-cache-dir )?/src\b", runs)


def test_dockerignore_keeps_every_package_and_drops_the_venv() -> None:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p) for p in patterns)

    packages = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    for needed in [*packages, "pyproject.toml", PYPROJECT["project"]["readme"]]:
        assert (ROOT / needed).exists() and not ignored(needed), needed
    assert ignored(".venv") and ignored(".git") and ignored("tests")


def test_it_runs_kvgate_as_a_numeric_non_root_user() -> None:
    assert only("USER").isdigit() and int(only("USER")) > 0  # runAsNonRoot needs a numeric uid
    assert json.loads(only("ENTRYPOINT")) == ["kvgate"]
    assert PYPROJECT["project"]["scripts"]["kvgate"] == "plugin.cli:main"
    cmd = json.loads(only("CMD"))
    assert cmd[0] == "proxy"
    args = build_parser().parse_args(cmd[1:])
    assert args.listen_host == "0.0.0.0" and str(args.listen_port) == only("EXPOSE")


def test_the_chart_names_the_image_this_file_builds() -> None:
    values = YAML(typ="safe").load((ROOT / "helm" / "kvgate" / "values.yaml").read_text())
    chart = YAML(typ="safe").load((ROOT / "helm" / "kvgate" / "Chart.yaml").read_text())
    image = f"{values['image']['repository']}:{values['image']['tag']}"
    assert f"docker build -t {image} ." in DOCKERFILE
    assert values["image"]["tag"] == chart["appVersion"] == PYPROJECT["project"]["version"]
