"""A real Prometheus server (Debian's `prometheus` package, installed by .ci/run) for end-to-end tests.

`PrometheusServer` writes a scrape config for static targets, starts `prometheus` on a free loopback
port with its TSDB in the test's tmp dir, waits for /-/ready and answers PromQL through the HTTP API.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.stack import stop_process, wait_http_ok
from store.redis_server import free_port

BINARY = shutil.which("prometheus")
MISSING = "prometheus is not installed (Debian: apt-get install prometheus; .ci/run installs it)"


@dataclass
class PrometheusServer:
    work_dir: Path
    jobs: Mapping[str, Sequence[str]]  # job name -> host:port targets serving /metrics
    scrape_interval: str = "1s"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.work_dir / "prometheus.log"

    def config(self) -> str:
        lines = ["global:", f"  scrape_interval: {self.scrape_interval}",
                 f"  evaluation_interval: {self.scrape_interval}", "scrape_configs:"]  # fmt: skip
        for job, targets in self.jobs.items():
            lines += [f"  - job_name: {job}", "    static_configs:",
                      f"      - targets: [{', '.join(repr(t) for t in targets)}]"]  # fmt: skip
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        if BINARY is None:
            raise RuntimeError(MISSING)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "prometheus.yml"
        config.write_text(self.config())
        tsdb = self.work_dir / "tsdb"
        args = [BINARY, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
                f"--web.listen-address=127.0.0.1:{self.port}"]  # fmt: skip
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        wait_http_ok(f"{self.url}/-/ready", timeout_s, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10.0)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10.0) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now (a list of {metric, value})."""
        data = self.api("query", query=expr, time=f"{time.time():.3f}")
        if data["resultType"] != "vector":
            raise AssertionError(f"{expr}: {data['resultType']}, not a vector")
        return list(data["result"])

    def targets_up(self) -> dict[str, str]:
        """scrape URL -> health ('up', 'down', 'unknown') of every active target."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets", state="active")["activeTargets"]}


def finite_values(result: Sequence[dict[str, Any]]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in result) if math.isfinite(v)]
