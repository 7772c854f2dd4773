"""`kvgate proxy --processes N`: N gateway processes on one port, one event loop each, one Redis.

mitmdump runs one asyncio loop on one thread (MITMPROXY.md §4), so a node's other cores need more
processes. The supervisor starts N `kvgate proxy` children on the same host and port with
SO_REUSEPORT (the kernel spreads new connections across their listening sockets), each with its own
gateway id (`<id>-p<k>`) and all on one Redis: the configured one, or an embedded redis-server the
supervisor itself runs (so quotas, leases and the prefix index stay global). It then watches them:

- a child that exits while the supervisor is not stopping is started again, after a back-off that
  grows while it keeps dying young (a crash loop costs no CPU);
- SIGTERM or SIGINT is passed to every child, which drains (new requests 503, live streams finish,
  bounded by `gateway.drain_timeout_ms`); children still alive after that and a grace period are
  killed; then the embedded Redis stops;
- each child gets the kernel's parent-death signal (SIGTERM, Linux), so a supervisor killed with
  SIGKILL does not leave gateways behind.

SO_REUSEPORT: mitmproxy has no option for it; its listener is `asyncio.start_server(handler, host,
port)` (mitmproxy/proxy/mode_servers.py). A child started with `--reuse-port` wraps
`asyncio.start_server` before mitmproxy starts so that it passes `reuse_port=True`
(`enable_reuse_port`). Should a mitmproxy upgrade listen some other way, the second child fails with
EADDRINUSE, the supervisor stops with a message that says so, and tests/e2e/test_processes.py fails.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plugin.config import load_config
from store.redis_server import EmbeddedRedis, stable_socket_path

logger = logging.getLogger("kvgate.supervisor")

RESTART_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # by the number of consecutive early deaths
EARLY_DEATH_S = 10.0  # a child that dies sooner than this after its start counts as crash-looping
CRASH_LOOP = 3  # early deaths in a row before the log says what to check
STOP_GRACE_S = 10.0  # after the drain timeout, before SIGKILL
PR_SET_PDEATHSIG = 1


def enable_reuse_port() -> None:
    """Make `asyncio.start_server` (mitmproxy's listener) bind with SO_REUSEPORT; idempotent."""
    original = asyncio.start_server
    if getattr(original, "kvgate_reuse_port", False):
        return

    @functools.wraps(original)
    async def start_server(*args: Any, **kwargs: Any) -> asyncio.Server:
        kwargs.setdefault("reuse_port", True)
        return await original(*args, **kwargs)

    start_server.kvgate_reuse_port = True  # type: ignore[attr-defined]
    asyncio.start_server = start_server


def _term_with_parent() -> None:
    """In a child before exec: SIGTERM it when the supervisor dies (Linux PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() == 1:  # the supervisor died before prctl took effect
            os._exit(1)


def child_argv(args: argparse.Namespace, *, redis_url: str, gateway_id: str) -> list[str]:
    """`kvgate proxy` arguments of one child: the supervisor's own, one Redis, its own id, SO_REUSEPORT."""
    out = ["--reuse-port", "--listen-host", args.listen_host, "--listen-port", str(args.listen_port),
           "--redis", redis_url, "--gateway-id", gateway_id]  # fmt: skip
    for flag, value in (("--config", args.config), ("--model", args.model), ("--confdir", args.confdir)):
        if value:
            out += [flag, value]
    if args.worker_max_concurrency:
        out += ["--worker-max-concurrency", str(args.worker_max_concurrency)]
    for url in args.worker:
        out += ["--worker", url]
    if args.log_connections:
        out.append("--log-connections")
    if args.mitmdump_args:
        out += ["--", *args.mitmdump_args]
    return out


@dataclass
class Child:
    index: int
    gateway_id: str
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    early_deaths: int = 0
    restart_at: float = 0.0  # when a dead child is due to start again
    restarts: int = 0


class Supervisor:
    """Starts, restarts and stops the children; see the module docstring."""

    def __init__(self, args: argparse.Namespace, spawn: Callable[[list[str]], subprocess.Popen[bytes]]):
        self.args = args
        self.spawn = spawn
        self.stopping = False
        self.redis: EmbeddedRedis | None = None
        base = args.gateway_id or f"{socket.gethostname()}-{os.getpid()}"
        self.children = [Child(k, f"{base}-p{k}") for k in range(args.processes)]
        self.drain_s = load_config(args.config).gateway.drain_timeout_ms / 1000

    def redis_url(self) -> str:
        if self.args.redis:
            return str(self.args.redis)
        if self.redis is None:
            name = self.args.gateway_id or f"port-{self.args.listen_port}"
            port = self.args.embedded_redis_port or None
            self.redis = EmbeddedRedis(port, unix_socket=stable_socket_path(name)).start()
            logger.warning("kvgate: embedded redis-server for %d processes at %s and %s",
                           len(self.children), self.redis.url, self.redis.unix_url)  # fmt: skip
        return self.redis.url

    def start(self, child: Child) -> None:
        argv = child_argv(self.args, redis_url=self.redis_url(), gateway_id=child.gateway_id)
        child.proc = self.spawn(argv)
        child.started = time.monotonic()

    def check(self, now: float) -> None:
        """Restart the children that died (after their back-off)."""
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                child.early_deaths = child.early_deaths + 1 if now - child.started < EARLY_DEATH_S else 0
                delay = RESTART_BACKOFF_S[min(child.early_deaths, len(RESTART_BACKOFF_S) - 1)]
                logger.warning("kvgate: gateway process %s exited with %s; restarting in %.1f s",
                               child.gateway_id, child.proc.returncode, delay)  # fmt: skip
                if child.early_deaths == CRASH_LOOP:
                    logger.warning(
                        "kvgate: %s keeps dying at start. If its log says the address is in use: SO_REUSEPORT"
                        " is set by wrapping asyncio.start_server (plugin/supervisor.py), and this mitmproxy "
                        "may listen some other way, or an unrelated process holds the port.",
                        child.gateway_id,
                    )
                child.proc, child.restart_at = None, now + delay
            if child.proc is None and now >= child.restart_at:
                child.restarts += 1
                self.start(child)

    def stop(self) -> None:
        """SIGTERM every child (they drain), SIGKILL what is left after the drain and a grace period."""
        live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_s + STOP_GRACE_S
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.redis is not None:
            self.redis.stop()

    def run(self) -> int:
        def on_signal(signum: int, _frame: object) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            for child in self.children:
                self.start(child)
            while not self.stopping:
                time.sleep(0.1)
                if not self.stopping:
                    self.check(time.monotonic())
        finally:
            self.stop()
        return 0


def run_supervisor(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")

    def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "plugin.cli", "proxy", *argv], preexec_fn=_term_with_parent
        )

    return Supervisor(args, spawn).run()
