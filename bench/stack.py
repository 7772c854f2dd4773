"""A local kvgate stack as real processes on loopback: Redis, emulated workers, agents, gateways.

`kvgate demo` and the live benchmarks build their clusters with this; every process is started
through the `kvgate` command line exactly as an operator would, polled until it answers, and
stopped (SIGTERM, then SIGKILL) when the stack closes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store.redis_server import EmbeddedRedis, free_port


class StackError(RuntimeError):
    pass


def kvgate_command(*args: str) -> list[str]:
    """`kvgate ARGS` with this interpreter, so it works inside any virtualenv without PATH. `-P`: the
    working directory is not put on sys.path, so a run started inside another checkout still runs this
    interpreter's kvgate, not that checkout's packages."""
    return [sys.executable, "-P", "-m", "plugin.cli", *args]


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll `url` until it answers 2xx; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if 200 <= resp.status < 300:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.05)
    raise StackError(f"{url} not ready after {timeout_s} s: {last}")


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM (kvgate's processes drain on it), then SIGKILL after `grace_s`; waits either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None

    def stop(self, grace_s: float = 10.0) -> None:
        stop_process(self.proc, grace_s)


@dataclass
class Stack:
    """Processes started so far; `close()` stops them in reverse order."""

    log_dir: Path
    redis: EmbeddedRedis | None = None
    processes: list[Process] = field(default_factory=list)
    worker_urls: list[str] = field(default_factory=list)
    gateway_urls: list[str] = field(default_factory=list)
    metrics_urls: dict[str, str] = field(default_factory=dict)  # gateway URL -> its metrics port's URL
    # each process in its own session, hence its own scheduler autogroup (Linux): CPU is then shared
    # per process, as between separate services, not per benchmark run (kvgate bench overhead)
    own_sessions: bool = False

    @property
    def redis_url(self) -> str:
        if self.redis is None:
            raise StackError("redis not started")
        return self.redis.url

    def start_redis(self) -> str:
        self.redis = EmbeddedRedis().start()
        return self.redis.url

    def spawn(
        self, name: str, args: Sequence[str], env: dict[str, str] | None = None, *, log_mode: str = "wb"
    ) -> Process:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with log.open(log_mode) as out:
            proc = subprocess.Popen(
                list(args), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                start_new_session=self.own_sessions,
            )  # fmt: skip
        process = Process(name, proc, log, tuple(args), env)
        self.processes.append(process)
        return process

    def restart(self, name: str, *, kill: bool = True, ready_url: str | None = None) -> None:
        """Stop process `name` (SIGKILL when `kill`: a crash; else SIGTERM and its drain) and start it
        again with the same command line, hence on the same port; its log is appended to. `ready_url`:
        poll it until the new process answers."""
        old = next(p for p in self.processes if p.name == name)
        if kill:
            old.proc.kill()
            old.proc.wait()
        else:
            old.stop()
        self.processes.remove(old)
        new = self.spawn(name, old.args, old.env, log_mode="ab")
        if ready_url is not None:
            wait_http_ok(ready_url, 30, new.proc)

    def start_worker(self, worker_id: str, *, model: str, profile: str, time_scale: float,
                     extra: Sequence[str] = ()) -> str:  # fmt: skip
        port = free_port()
        args = ["worker", "--port", str(port), "--model", model, "--profile", profile,
                "--time-scale", str(time_scale), "--worker-id", worker_id, *extra]  # fmt: skip
        process = self.spawn(f"worker-{worker_id}", kvgate_command(*args))
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", 30, process.proc)
        self.worker_urls.append(url)
        return url

    def start_agent(self, worker_id: str, worker_url: str, *, model: str, extra: Sequence[str] = ()) -> None:
        args = ["agent", "--worker-url", worker_url, "--model", model, "--worker-id", worker_id,
                "--redis", self.redis_url, *extra]  # fmt: skip
        self.spawn(f"agent-{worker_id}", kvgate_command(*args))

    def start_gateway(self, name: str, *, config: Path | None = None, extra: Sequence[str] = ()) -> str:
        port, metrics_port = free_port(), free_port()
        args = ["proxy", "--listen-port", str(port), "--redis", self.redis_url, *extra]
        if "--metrics-port" not in extra:  # never the shared default: two gateways would collide
            args += ["--metrics-port", str(metrics_port)]
        if config is not None:
            args += ["--config", str(config)]
        process = self.spawn(f"gateway-{name}", kvgate_command(*args))
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/readyz", 60, process.proc)
        self.gateway_urls.append(url)
        if "--metrics-port" not in extra:
            self.metrics_urls[url] = f"http://127.0.0.1:{metrics_port}"
            # the metrics port's /readyz reads a snapshot the loop's refresher writes a moment later
            wait_http_ok(f"{self.metrics_urls[url]}/readyz", 30, process.proc)
        return url

    def stop_process(self, name: str) -> None:
        for process in self.processes:
            if process.name == name:
                process.stop()

    def close(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(Exception):
                process.stop()
        self.processes.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
