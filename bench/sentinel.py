"""A local Sentinel setup from one redis-server 7 binary (bench/redis7.py): a primary, a replica and
one sentinel (quorum 1) on loopback, none of them persisting anything. `failover()` SIGKILLs the
current primary, waits until the sentinel has promoted the replica, then starts the killed server
again on its port as a replica of the new primary, so the next failover has a replica to promote.

Used by `kvgate bench chaos --redis-topology sentinel` (fault `redis_failover`) and by
tests/e2e/test_faults.py (the gateway follows a failover)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from store.redis_server import free_port

SERVICE = "kvg"
DOWN_AFTER_MS = 1000  # the sentinel declares the primary down after this long without an answer


class SentinelSet:
    def __init__(self, binary: str, env: dict[str, str], work: Path) -> None:
        self.binary, self.env, self.work = binary, env, work
        self.ports = [free_port(), free_port()]  # data servers; which one is primary changes
        self.sentinel_port = free_port()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.sentinel: subprocess.Popen[bytes] | None = None
        self.primary_port = self.ports[0]

    @property
    def url(self) -> str:
        """What gateways and agents use: the sentinel, which names the current primary."""
        return f"sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}"

    @property
    def primary_url(self) -> str:
        return f"redis://127.0.0.1:{self.primary_port}/0"

    def _server(self, port: int, replica_of: int | None) -> None:
        work = self.work / f"redis-{port}"
        work.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(work)]  # fmt: skip
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        log = (work / "log").open("ab")
        self.procs[port] = subprocess.Popen(
            args, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=work
        )

    def start(self, timeout_s: float = 40.0) -> SentinelSet:
        primary, replica = self.ports
        self._server(primary, None)
        self._server(replica, primary)
        conf = self.work / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\nsentinel monitor {SERVICE} 127.0.0.1 {primary} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
        )
        self.sentinel = subprocess.Popen(
            [self.binary, str(conf), "--sentinel"], env=self.env, cwd=self.work,
            stdout=(self.work / "sentinel.log").open("ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.wait_replica_ready(timeout_s)
        return self

    def _ask_sentinel(self, *args: str) -> object:
        client = redis.Redis(port=self.sentinel_port, decode_responses=True, socket_timeout=1)
        try:
            return client.execute_command("SENTINEL", *args)  # type: ignore[no-untyped-call]
        finally:
            client.close()

    def _replica_ready(self) -> bool:
        """The replica is in sync and the sentinel knows it as a healthy replica: a failover can run.
        (A sentinel learns of replicas from the primary's INFO, every 10 s at first.)"""
        replica = next(p for p in self.ports if p != self.primary_port)
        try:
            info = redis.Redis(port=replica, socket_timeout=1).info("replication")
            known = self._ask_sentinel("REPLICAS", SERVICE)
        except (redis.RedisError, OSError):
            return False
        if info.get("master_link_status") != "up" or not isinstance(known, list):
            return False
        return any(
            int(r.get("port", 0)) == replica and "down" not in r.get("flags", "") and "disconnected" not in
            r.get("flags", "") for r in known
        )  # fmt: skip

    def wait_replica_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._replica_ready():
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel setup has no healthy replica")
            time.sleep(0.2)

    def failover(self, timeout_s: float = 30.0) -> float:
        """Kill the primary; return the seconds until the sentinel names the promoted replica and it
        answers as master. Then the killed server rejoins as a replica (in the background)."""
        old = self.primary_port
        new = next(p for p in self.ports if p != old)
        started = time.monotonic()
        self.procs[old].kill()
        self.procs[old].wait()
        deadline = started + timeout_s
        while True:
            try:
                named = self._ask_sentinel("GET-MASTER-ADDR-BY-NAME", SERVICE)
                role = redis.Redis(port=new, socket_timeout=1).info("replication").get("role")
            except (redis.RedisError, OSError):
                named, role = None, None
            if isinstance(named, list | tuple) and int(named[1]) == new and role == "master":
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel did not promote the replica")
            time.sleep(0.05)
        promoted = time.monotonic() - started
        self.primary_port = new
        self._server(old, new)  # back as a replica of the new primary
        return promoted

    def stop(self) -> None:
        for proc in [*self.procs.values(), *([self.sentinel] if self.sentinel else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
