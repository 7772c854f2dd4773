"""The metrics port: /metrics, /healthz and /readyz on a listener of their own (issue 12, issue 10).

A `ThreadingHTTPServer` on a daemon thread, so a scrape or a probe never waits for the proxy's event
loop: /metrics renders the prometheus-client registry (its values are thread-safe), /healthz answers
while the process runs, and /readyz answers from the `Readiness` snapshot the event loop's refresher
(plugin/local.py `MetricsRefresher`) last wrote. A saturated loop makes that snapshot and the
scrape-time gauges older (its age is in the /readyz body), never the answer slow.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9464  # the OpenTelemetry Prometheus exporter's port, as issue 12 asks


@dataclass
class Readiness:
    """What /readyz says, written by the event loop (one attribute store each: no lock needed)."""

    gateway: str = ""
    redis: bool = False
    live_workers: int = 0
    draining: bool = False
    updated_at: float = 0.0  # time.monotonic() of the last refresh; 0 = never

    @property
    def ready(self) -> bool:
        return self.redis and self.live_workers > 0 and not self.draining


class MetricsServer:
    """Serves one registry and one readiness snapshot on host:port, off the event loop."""

    def __init__(self, registry: CollectorRegistry, readiness: Readiness, host: str, port: int) -> None:
        self.registry, self.readiness = registry, readiness
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, ctype, body = server.answer(self.path.split("?", 1)[0])
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes every few seconds are not news

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="kvgate-metrics", daemon=True)

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def answer(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        r = self.readiness
        age = round(time.monotonic() - r.updated_at, 3) if r.updated_at else None
        if path == "/healthz":
            body = {"status": "alive", "gateway": r.gateway, "draining": r.draining}
            return 200, "application/json", json.dumps(body).encode()
        if path == "/readyz":
            body = {**asdict(r), "status": "ok" if r.ready else "unavailable", "age_s": age}
            del body["updated_at"]
            return 200 if r.ready else 503, "application/json", json.dumps(body).encode()
        return 404, "application/json", b'{"error": "not found: /metrics, /healthz, /readyz"}'

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
