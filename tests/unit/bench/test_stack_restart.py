"""bench/stack.py's Stack.restart: the same command line again, hence the same port, in a new process."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

from bench.stack import Stack
from store.redis_server import free_port


def test_restart_runs_the_same_command_on_the_same_port(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with Stack(log_dir=tmp_path) as stack:
        first = stack.spawn("web", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"])
        stack.restart("web", kill=False, ready_url=url)  # SIGTERM, then the same command again
        stack.restart("web", kill=True, ready_url=url)
        (second,) = [p for p in stack.processes if p.name == "web"]
        assert first.proc.poll() is not None and second.proc.poll() is None
        assert second.proc.pid != first.proc.pid and second.args == first.args
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200
    assert second.proc.poll() is not None  # the stack stopped the new process too
