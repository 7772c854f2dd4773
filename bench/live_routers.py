"""The routers `kvgate bench live` puts in front of the emulated workers, each started as its users run it.

Peers run from their own virtualenvs, created on first use under --peers-dir (default
~/.cache/kvgate-peers) with the pinned PyPI release; a peer whose venv cannot be built is reported
and skipped. Retries and circuit breakers are switched off wherever the router has a switch, so an
error reaches the client instead of being retried away.

  kvgate         one gateway (default config) + one agent per worker, fresh Redis per run
  kvgate_x2      two gateway processes on that Redis; the client alternates between them
  round_robin    bench/live_forward.py in round-robin mode (no kvgate code on the path)
  smg            PyPI smg 1.13.0, --policy cache_aware
  sglang         PyPI sglang-router 0.3.2, --policy cache_aware
  vllm_router    PyPI vllm-router 0.1.17, --policy cache_aware
  dynamo_select  PyPI ai-dynamo-runtime 1.6.1 `python -m dynamo.select_service` fed by the workers'
                 KV events, behind bench/live_forward.py (labelled as such)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.stack import Stack, StackError, kvgate_command, wait_http_ok
from store.redis_server import free_port

PEERS_DIR = Path(os.environ.get("KVGATE_PEERS_DIR", Path.home() / ".cache" / "kvgate-peers"))
PEER_PYTHON = os.environ.get("KVGATE_PEER_PYTHON", "python3.12")

# router name -> (venv name, pip requirements); the Dynamo venv also runs the forwarder (aiohttp), which
# hashes prompts with Dynamo's own block hash (dynamo.llm.compute_block_hash_for_seq)
PEER_PACKAGES: dict[str, tuple[str, str]] = {
    "smg": ("smg", "smg==1.13.0"),
    "sglang": ("sglang", "sglang-router==0.3.2"),
    "vllm_router": ("vllm_router", "vllm-router==0.1.17"),
    "dynamo_select": ("dynamo", "ai-dynamo-runtime==1.6.1 aiohttp"),
    "aiperf": ("aiperf", "aiperf==0.13.0"),  # the client of `kvgate bench live --client aiperf`
}
ROUTERS = ("kvgate", "kvgate_x2", "smg", "sglang", "vllm_router", "dynamo_select", "round_robin")
LABELS = {
    "kvgate": "kvgate (1 gateway process)",
    "kvgate_x2": "kvgate_x2 (2 gateway processes on one Redis, client alternates)",
    "round_robin": "round_robin (thin forwarder)",
    "smg": "smg 1.13.0 cache_aware",
    "sglang": "sglang-router 0.3.2 cache_aware",
    "vllm_router": "vllm-router 0.1.17 cache_aware",
    "dynamo_select": "dynamo_select (ai-dynamo-runtime 1.6.1 selection service + thin forwarder)",
}


class PeerUnavailable(RuntimeError):
    """A peer whose virtualenv or binary is missing; the run skips it and says why."""


def peer_venv(router: str, peers_dir: Path = PEERS_DIR, install: bool = True) -> Path:
    """The peer's virtualenv, created and filled with its pinned release if missing."""
    name, requirement = PEER_PACKAGES[router]
    venv = peers_dir / name
    marker = venv / ".kvgate-installed"
    if marker.exists() and marker.read_text() == requirement:
        return venv
    if not install:
        raise PeerUnavailable(f"{router}: no virtualenv at {venv} (run without --no-install)")
    python = shutil.which(PEER_PYTHON) or sys.executable
    peers_dir.mkdir(parents=True, exist_ok=True)
    log = peers_dir / f"{name}.install.log"
    with log.open("wb") as out:
        pip = [str(venv / "bin" / "pip"), "install", "-q", *requirement.split()]
        steps = [[python, "-m", "venv", str(venv)], pip]
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise PeerUnavailable(f"{router}: `{' '.join(step)}` failed; see {log}")
    marker.write_text(requirement)
    return venv


@dataclass
class Fleet:
    """The emulated workers every router is put in front of."""

    urls: list[str]
    kv_endpoints: list[str]  # ZMQ PUB endpoint of each worker's KV events (vLLM format)
    model: str
    block_size: int


@dataclass
class RunningRouter:
    """A router in front of the fleet: the URLs the client sends to, and how to take it down."""

    name: str
    urls: list[str]
    stack: Stack
    notes: list[str] = field(default_factory=list)

    def stop(self) -> None:
        self.stack.close()


Starter = Callable[[Fleet, Path, Path], RunningRouter]


def _peer_bin(router: str, peers_dir: Path, binary: str) -> str:
    path = peer_venv(router, peers_dir) / "bin" / binary
    if not path.exists():
        raise PeerUnavailable(f"{router}: {path} is missing")
    return str(path)


def start_kvgate(
    fleet: Fleet, log_dir: Path, peers_dir: Path, gateways: int = 1, config: Path | None = None
) -> RunningRouter:
    stack = Stack(log_dir=log_dir)
    try:
        stack.start_redis()
        for i, url in enumerate(fleet.urls):
            stack.start_agent(f"w{i}", url, model=fleet.model)
        urls = [stack.start_gateway(f"g{g}", config=config) for g in range(gateways)]
        _wait_registered(stack.metrics_urls[urls[0]], fleet.model, len(fleet.urls))
    except BaseException:
        stack.close()
        raise
    return RunningRouter("kvgate" if gateways == 1 else f"kvgate_x{gateways}", urls, stack)


def _wait_registered(metrics_url: str, model: str, workers: int, timeout_s: float = 30.0) -> None:
    """Until the gateway's mirror has every worker routable (its kvgate_workers gauge)."""
    deadline = time.monotonic() + timeout_s
    wanted = f'kvgate_workers{{model="{model}",state="routable"}}'
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=2) as resp:
                text = resp.read().decode()
            for line in text.splitlines():
                if line.startswith(wanted) and float(line.rsplit(" ", 1)[1]) >= workers:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise StackError(f"{metrics_url}: {workers} workers of {model} not routable after {timeout_s} s")


def _spawn_http(stack: Stack, name: str, args: Sequence[str], health: str, timeout_s: float = 60) -> str:
    process = stack.spawn(name, args)
    try:
        wait_http_ok(health, timeout_s, process.proc)
    except StackError as e:
        tail = process.log.read_text(errors="replace")[-1500:] if process.log.exists() else ""
        raise StackError(f"{e}\n--- {process.log} ---\n{tail}") from None
    return health.rsplit("/", 1)[0]


def start_round_robin(fleet: Fleet, log_dir: Path, peers_dir: Path) -> RunningRouter:
    stack = Stack(log_dir=log_dir)
    port = free_port()
    args = [sys.executable, "-m", "bench.live_forward", "--port", str(port)]
    for url in fleet.urls:
        args += ["--worker", url]
    try:
        base = _spawn_http(stack, "round_robin", args, f"http://127.0.0.1:{port}/health")
    except BaseException:
        stack.close()
        raise
    return RunningRouter("round_robin", [base], stack)


def start_sglang_family(router: str, fleet: Fleet, log_dir: Path, peers_dir: Path) -> RunningRouter:
    """smg, sglang-router and vllm-router share the SGLang router's command line."""
    binary = {"smg": "smg", "sglang": "python", "vllm_router": "vllm-router"}[router]
    exe = _peer_bin(router, peers_dir, binary)
    port = free_port()
    prefix = [exe, "-m", "sglang_router.launch_router"] if router == "sglang" else [exe]
    if router == "smg":
        prefix = [exe, "launch"]
    args = [
        *prefix,
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *fleet.urls,
        "--policy", "cache_aware",
        "--disable-retries", "--disable-circuit-breaker",
        "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    stack = Stack(log_dir=log_dir)
    try:
        base = _spawn_http(stack, router, args, f"http://127.0.0.1:{port}/health", timeout_s=90)
        wait_http_ok(f"{base}/v1/models", 60)
    except BaseException:
        stack.close()
        raise
    return RunningRouter(router, [base], stack)


def start_dynamo_select(fleet: Fleet, log_dir: Path, peers_dir: Path) -> RunningRouter:
    python = _peer_bin("dynamo_select", peers_dir, "python")
    port = free_port()
    stack = Stack(log_dir=log_dir)
    try:
        args = [python, "-m", "dynamo.select_service", "--port", str(port)]
        select = _spawn_http(stack, "dynamo_select_service", args, f"http://127.0.0.1:{port}/health")
        for i, (url, endpoint) in enumerate(zip(fleet.urls, fleet.kv_endpoints, strict=True)):
            worker = {"worker_id": i, "model_name": fleet.model, "endpoint": url,
                      "block_size": fleet.block_size, "kv_events_endpoints": {"0": endpoint}}  # fmt: skip
            _post_json(f"{select}/workers", worker)
        wait_http_ok(f"{select}/ready", 30)
        fwd_port = free_port()
        fwd = [sys.executable, "-m", "bench.live_forward", "--port", str(fwd_port), "--select-url", select,
               "--model", fleet.model]  # fmt: skip
        for url in fleet.urls:
            fwd += ["--worker", url]
        base = _spawn_http(stack, "dynamo_forwarder", fwd, f"http://127.0.0.1:{fwd_port}/health")
    except BaseException:
        stack.close()
        raise
    return RunningRouter("dynamo_select", [base], stack, ["thin forwarder in front of Dynamo's selection"])


def _post_json(url: str, body: object) -> None:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def starter(router: str, kvgate_config: Path | None = None) -> Starter:
    """How to start `router`; kvgate's gateways with `kvgate_config` (None: the default config)."""
    if router == "kvgate":
        return lambda fleet, logs, peers: start_kvgate(fleet, logs, peers, config=kvgate_config)
    if router == "kvgate_x2":
        return lambda fleet, logs, peers: start_kvgate(fleet, logs, peers, gateways=2, config=kvgate_config)
    if router == "round_robin":
        return start_round_robin
    if router in ("smg", "sglang", "vllm_router"):
        return lambda fleet, logs, peers: start_sglang_family(router, fleet, logs, peers)
    if router == "dynamo_select":
        return start_dynamo_select
    raise ValueError(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")


__all__ = ["LABELS", "PEER_PACKAGES", "ROUTERS", "Fleet", "PeerUnavailable", "RunningRouter", "starter"]
_ = kvgate_command  # the kvgate processes start through Stack (kvgate_command)
