"""`kvgate bench chaos --seconds N [--json PATH]`: streaming load through two gateways on one Redis,
with 4 emulated workers and their agents, while random faults are injected; invariants checked
continuously (issue 10).

Faults, in a shuffled round-robin so a run of >= 5 faults covers >= 4 kinds: SIGKILL of a worker,
of an agent or of a gateway (each restarted on the same port after a pause), a Redis SIGSTOP longer
than a worker lease, a Redis SIGKILL + restart on the same port (empty), slow Redis replies (every
gateway and agent reaches Redis through `bench/slow_redis.py`, a proxy whose delay is raised to
SLOW_REDIS_S for a while), and slow clients: idle connections, connections that stop mid-headers and
slowloris bodies (a byte every 0.2 s), which the gateways must cut off at
`limits.client_request_timeout_ms` (plugin/client_deadline.py) while serving everyone else. Clients
leave mid-stream now and then (a read cut short).

`--redis-topology sentinel`: the gateways and agents use `sentinel://` on a primary + replica +
sentinel from one redis-server 7 binary (bench/sentinel.py); fault `redis_failover` SIGKILLs the
primary, the sentinel promotes the replica (recovery counts from the promotion; `failover_s` is the
kill-to-promotion time) and the killed server rejoins as a replica. Redis pause/restart and slow
Redis are standalone-only. `--redis-failure open`: both gateways run `gateway.redis_failure =
"open"`; `max_running` (workers' own counters) is then held against `running_bound`, total × (2 −
1/gateways), not the quota (docs/REDIS.md).

Invariants, checked continuously and at the end:
- running <= quota, at the workers' own counters: every worker logs when each request starts and
  ends on CLOCK_MONOTONIC (GET /kvgate/held_log, polled); the overshoot is the largest number of
  requests running at once across all workers, minus the quota, swept over the merged logs (exact:
  no sampling, no skew between workers read one after another). A killed worker's open requests
  end at its last good poll;
- every slot returns: no live lease in Redis one lease period after the load stops;
- every request answered exactly once with the right kind of answer: 200, or 429/503 with
  Retry-After, or a broken stream only when its gateway or its worker was killed under it (counted
  apart; a stream its worker broke off ends with an SSE error event, not [DONE]); never a 500;
  a client request id never reaches workers under two lease ids (duplicated);
- recovery after each fault: seconds from the restore until a request through every gateway is
  200, against one lease period;
- slow clients cut off: every slow connection closed by the gateway within its timeout + 2.5 s;
- memory flat: every gateway process's RSS, sampled every 2 s; for each gateway's longest-lived
  process, the growth from the end of its warm-up (WARMUP_S after it started, or a quarter of the run
  if shorter) to its last sample stays <= MEMORY_BOUND_MB.

Writes the issue's JSON interface: {"sent", "answered_once", "lost", "duplicated",
"wrongly_rejected", "status_500", "slots_leaked", "max_quota_overshoot", "max_recovery_s",
"lease_period_s", "quota_enforced_after_redis_restart", "faults": {kind: count}} (plus details).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench import redis7
from bench.sentinel import SentinelSet
from bench.slow_redis import SlowRedisProxy
from bench.stack import Process, Stack, kvgate_command, wait_http_ok
from runtime.tasks import spawn
from store.redis_server import EmbeddedRedis, free_port
from store.scripts import quota_key
from store.slots import live_leases

MODEL = "chaos-model"
QUOTA = 6
WORKERS = 4
LEASE_MS = 4000
# per worker port: its process's boot time, the log cursor, the last good poll, its open requests
HeldCursor = tuple[float, int, float, dict[str, float]]
KINDS = ("worker_kill", "agent_kill", "gateway_kill", "redis_pause", "redis_restart", "slow_redis",
         "slow_clients")  # fmt: skip
# on a Sentinel setup (--redis-topology sentinel) the clients reach the primary the sentinel names, not
# the slow-Redis proxy, and a pause or an empty restart of the primary would be a failover too
SENTINEL_KINDS = ("worker_kill", "agent_kill", "gateway_kill", "slow_clients", "redis_failover")
SLOW_REDIS_S = 0.3  # per reply, for SLOW_REDIS_FOR_S: well under gateway.redis_timeout_ms (2 s)
SLOW_REDIS_FOR_S = 6.0
CLIENT_TIMEOUT_MS = 3000  # limits.client_request_timeout_ms of the chaos gateways (default 60 s)
WARMUP_S = 30.0
MEMORY_BOUND_MB = 10.0


@dataclass
class Tally:
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    broken_expected: int = 0  # a stream cut because its gateway was SIGKILLed under it
    broken_by_worker_kill: int = 0  # a stream cut because its worker was SIGKILLed under it
    lost: int = 0  # no answer, or a broken stream, that no fault explains
    lost_why: Counter[str] = field(default_factory=Counter)  # what the client saw, per lost request
    left: int = 0  # the client left mid-stream on purpose
    wrongly_rejected: int = 0  # a rejection without Retry-After, or one outside every fault window
    sampled_overshoot: int = 0  # from /kvgate/inflight read worker after worker (skewed: reported apart)
    recoveries: list[float] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    lease_ids: dict[str, set[str]] = field(default_factory=dict)  # client id -> lease ids at workers
    quota_after_restart: list[bool] = field(default_factory=list)
    failover_s: list[float] = field(default_factory=list)  # primary killed -> replica promoted
    slow_clients: int = 0  # slow connections opened
    slow_clients_not_cut: int = 0  # ... that no gateway closed within its timeout + 2.5 s
    rss: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)  # gateway -> (t, pid, MB)
    held_events: list[tuple[float, int]] = field(default_factory=list)  # (monotonic s, +1|-1), all workers


class Chaos:
    def __init__(
        self,
        seconds: float,
        seed: int,
        log_dir: Path,
        kinds: tuple[str, ...] = KINDS,
        redis_failure: str = "closed",
        topology: str = "standalone",
    ) -> None:
        self.seconds = seconds
        self.topology = topology
        self.sentinel: SentinelSet | None = None
        self.redis_failure = redis_failure
        self.kinds = kinds
        self.rng = random.Random(seed)
        self.stack = Stack(log_dir)
        self.redis_port = free_port()
        self.tally = Tally()
        self.worker_ports: list[int] = []
        self.gateway_ports: list[int] = []
        self.procs: dict[str, Process] = {}
        self.killed_gateway: int | None = None  # index of the gateway being killed right now
        self.kills: Counter[str] = Counter()  # kills so far, counted at the kill
        self.fault_until = 0.0  # monotonic end of the current fault window (+ recovery)
        self.stop = asyncio.Event()
        self.config = log_dir / "chaos.toml"
        self.proxy: SlowRedisProxy | None = None
        self.started: dict[int, float] = {}  # gateway pid -> monotonic start

    # -- processes ---------------------------------------------------------------------------------
    def start_redis(self) -> None:
        self.stack.redis = EmbeddedRedis(self.redis_port).start()

    def start_sentinel(self) -> None:
        found = redis7.tls_redis_server()
        if found is None:
            raise SystemExit("--redis-topology sentinel needs redis-server 7: set KVGATE_TLS_REDIS_SERVER")
        self.sentinel = SentinelSet(*found, self.stack.log_dir / "sentinel").start()

    @property
    def redis_url(self) -> str:
        """What the gateways and agents use: the slow-Redis proxy in front of the server, or the
        sentinel on a Sentinel setup."""
        if self.sentinel is not None:
            return self.sentinel.url
        assert self.proxy is not None
        return self.proxy.url

    @property
    def primary_url(self) -> str:
        """The server itself (for the checks the bench makes): the current primary on a Sentinel setup."""
        return self.sentinel.primary_url if self.sentinel is not None else self.stack.redis_url

    def spawn(self, name: str, args: list[str]) -> Process:
        process = self.stack.spawn(name, kvgate_command(*args))
        self.procs[name] = process
        return process

    def start_worker(self, i: int) -> None:
        port = self.worker_ports[i]
        args = ["worker", "--port", str(port), "--model", MODEL, "--time-scale", "0.2",
                "--worker-id", f"w{i}", "--stream-interval-ms", "20"]  # fmt: skip
        process = self.spawn(f"worker-{i}", args)
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30, process.proc)

    def start_agent(self, i: int) -> None:
        args = ["agent", "--worker-url", f"http://127.0.0.1:{self.worker_ports[i]}", "--model", MODEL,
                "--worker-id", f"w{i}", "--redis", self.redis_url, "--heartbeat-ms", "500",
                "--max-concurrency", "4"]  # fmt: skip
        self.spawn(f"agent-{i}", args)

    def start_gateway(self, i: int, wait: bool = True) -> None:
        port = self.gateway_ports[i]
        args = ["proxy", "--listen-port", str(port), "--redis", self.redis_url, "--gateway-id",
                f"gw{i}", "--config", str(self.config)]  # fmt: skip
        process = self.spawn(f"gateway-{i}", args)
        self.started[process.proc.pid] = time.monotonic()
        if wait:
            wait_http_ok(f"http://127.0.0.1:{port}/readyz", 60, process.proc)

    def kill(self, name: str) -> None:
        process = self.procs[name]
        if process.proc.poll() is None:
            process.proc.send_signal(signal.SIGKILL)
            process.proc.wait()

    def setup(self) -> None:
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(
            f'[gateway]\nredis_failure = "{self.redis_failure}"\n\n'
            f'[models."{MODEL}"]\ntotal = {QUOTA}\n\n[admission]\nlease_ms = {LEASE_MS}\n'
            f"renew_every_ms = 1000\nmax_wait_ms = 20000\n\n[routing]\nrefresh_ms = 200\n\n"
            f"[limits]\nclient_request_timeout_ms = {CLIENT_TIMEOUT_MS}\n"
        )
        if self.topology == "sentinel":
            self.start_sentinel()
        else:
            self.start_redis()
            self.proxy = SlowRedisProxy(self.redis_port).start()
        self.worker_ports = [free_port() for _ in range(WORKERS)]
        self.gateway_ports = [free_port() for _ in range(2)]
        for i in range(WORKERS):
            self.start_worker(i)
            self.start_agent(i)
        time.sleep(1.5)  # agents register
        for i in range(2):
            self.start_gateway(i)

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.gateway_ports]

    # -- load --------------------------------------------------------------------------------------
    async def client(self, session: aiohttp.ClientSession, n: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            g = (n + i) % 2
            rid = f"c{n}-{i}"
            leave = self.rng.random() < 0.05
            text = f"tenant {n % 3} question {i} " * 20
            body = {"model": MODEL, "stream": True, "max_tokens": self.rng.randint(8, 48),
                    "messages": [{"role": "user", "content": text}]}  # fmt: skip
            self.tally.sent += 1
            kills_before = dict(self.kills)
            try:
                async with session.post(
                    f"{self.gateway_urls[g]}/v1/chat/completions", json=body, headers={"x-request-id": rid},
                    timeout=aiohttp.ClientTimeout(total=60),
                ) as resp:  # fmt: skip
                    if leave and resp.status == 200:
                        await resp.content.read(64)
                        self.tally.left += 1
                        continue
                    data = await resp.read()
                    self.tally.statuses[resp.status] += 1
                    if resp.status == 200 and not data.rstrip().endswith(b"[DONE]"):
                        self.broken(
                            kills_before, g, "stream without [DONE]: " + data[-120:].decode(errors="replace")
                        )
                    elif resp.status in (429, 503):
                        in_fault = time.monotonic() < self.fault_until
                        if "Retry-After" not in resp.headers or not in_fault:
                            self.tally.wrongly_rejected += 1
                    elif resp.status != 200:
                        self.tally.wrongly_rejected += resp.status != 500
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                self.broken(kills_before, g, type(e).__name__)
                await asyncio.sleep(0.2)

    def broken(self, kills_before: dict[str, int], gateway: int, why: str) -> None:
        """A stream cut short or a failed exchange: explained by a kill during it, or lost."""
        if self.killed_gateway == gateway or self.kills["gateway_kill"] > kills_before.get("gateway_kill", 0):
            self.tally.broken_expected += 1
        elif self.kills["worker_kill"] > kills_before.get("worker_kill", 0):
            self.tally.broken_by_worker_kill += 1  # ends with an SSE error event (or cut before headers)
        else:
            self.tally.lost += 1
            self.tally.lost_why[why] += 1

    async def held_logs(self, session: aiohttp.ClientSession) -> None:
        """Collect every worker's start/end log (see the module doc) until the load stops, then once more."""
        cursors: dict[int, HeldCursor] = {}
        while True:
            final = self.stop.is_set()
            for port in self.worker_ports:
                await self.poll_held_log(session, port, cursors)
            if final:
                break
            await asyncio.sleep(0.5)
        for _boot, _next, polled, open_ in cursors.values():
            self.tally.held_events += [(polled, -1)] * len(open_)

    async def poll_held_log(
        self, session: aiohttp.ClientSession, port: int, cursors: dict[int, HeldCursor]
    ) -> None:
        boot, since, polled, open_ = cursors.get(port, (0.0, 0, 0.0, {}))
        try:
            async with session.get(
                f"http://127.0.0.1:{port}/kvgate/held_log", params={"since": str(since)},
                timeout=aiohttp.ClientTimeout(total=2),
            ) as resp:  # fmt: skip
                data = await resp.json()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return
        if data["boot"] != boot:  # restarted: what ran on the killed process ended by its last poll
            self.tally.held_events += [(polled, -1)] * len(open_)
            boot, since, open_ = data["boot"], 0, {}
        now = time.monotonic()
        for t, delta, rid in data["entries"]:
            self.tally.held_events.append((float(t), int(delta)))
            if delta > 0:
                open_[f"{rid}@{t}"] = t
            else:
                for key in [k for k in open_ if k.startswith(f"{rid}@")][:1]:
                    del open_[key]
        cursors[port] = (boot, int(data["next"]), now, open_)

    async def sampler(self, session: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            running = 0
            for port in self.worker_ports:
                try:
                    async with session.get(
                        f"http://127.0.0.1:{port}/kvgate/inflight", timeout=aiohttp.ClientTimeout(total=1)
                    ) as resp:
                        ids = (await resp.json())["request_ids"]
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                    continue
                running += len(ids)
                for lease in ids:
                    client, _, _ = str(lease).rpartition(".")
                    self.tally.lease_ids.setdefault(client or lease, set()).add(lease)
            self.tally.sampled_overshoot = max(self.tally.sampled_overshoot, running - QUOTA)
            await asyncio.sleep(0.1)

    # -- faults ------------------------------------------------------------------------------------
    async def all_gateways_serve(self, session: aiohttp.ClientSession) -> bool:
        for url in self.gateway_urls:
            body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "probe"}]}
            try:
                async with session.post(
                    f"{url}/v1/chat/completions", json=body, headers={"x-kvgate-priority": "high"},
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as resp:  # fmt: skip
                    await resp.read()
                    if resp.status != 200:
                        return False
            except (aiohttp.ClientError, TimeoutError, OSError):
                return False
        return True

    async def recovered_after(self, session: aiohttp.ClientSession, restored: float) -> float:
        deadline = restored + 60
        while time.monotonic() < deadline:
            if await self.all_gateways_serve(session):
                return time.monotonic() - restored
            await asyncio.sleep(0.1)
        return 60.0

    async def fault(self, kind: str, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        self.fault_until = float("inf")
        if kind == "worker_kill":
            i = self.rng.randrange(WORKERS)
            self.kills[kind] += 1
            self.kill(f"worker-{i}")
            await asyncio.sleep(2.0)
            await loop.run_in_executor(None, self.start_worker, i)
        elif kind == "agent_kill":
            i = self.rng.randrange(WORKERS)
            self.kill(f"agent-{i}")
            await asyncio.sleep(2.0)
            self.start_agent(i)
        elif kind == "gateway_kill":
            i = self.rng.randrange(2)
            self.killed_gateway = i
            self.kills[kind] += 1
            self.kill(f"gateway-{i}")
            await asyncio.sleep(1.0)
            await loop.run_in_executor(None, self.start_gateway, i)
            self.killed_gateway = None
        elif kind == "redis_pause":
            assert self.stack.redis is not None and self.stack.redis.pid is not None
            os.kill(self.stack.redis.pid, signal.SIGSTOP)
            await asyncio.sleep(LEASE_MS / 1000 + 1.0)
            os.kill(self.stack.redis.pid, signal.SIGCONT)
        elif kind == "redis_restart":
            assert self.stack.redis is not None and self.stack.redis.pid is not None
            os.kill(self.stack.redis.pid, signal.SIGKILL)
            self.stack.redis.stop()
            await asyncio.sleep(0.5)
            self.start_redis()
        elif kind == "slow_redis":
            assert self.proxy is not None
            self.proxy.delay_s = SLOW_REDIS_S
            await asyncio.sleep(SLOW_REDIS_FOR_S)
            self.proxy.delay_s = 0.0
        elif kind == "slow_clients":
            await self.slow_clients()
        elif kind == "redis_failover":
            assert self.sentinel is not None
            await loop.run_in_executor(None, self.sentinel.wait_replica_ready, 60.0)  # the last one rejoined
            self.tally.failover_s.append(round(await loop.run_in_executor(None, self.sentinel.failover), 3))
        restored = time.monotonic()
        self.tally.faults[kind] += 1
        recovery = await self.recovered_after(session, restored)
        self.tally.recoveries.append(round(recovery, 3))
        self.fault_until = time.monotonic() + 1.0  # answers already under way when it recovered
        if kind in ("redis_restart", "redis_failover"):  # the server now serving has the quota
            self.tally.quota_after_restart.append(await self.quota_enforced())

    async def slow_clients(self) -> None:
        """Idle connections, connections stopped mid-headers and slowloris bodies against every
        gateway, all at once; each must be closed by its gateway within its timeout + 2.5 s."""
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "slow " * 40}]}).encode()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        shapes = [(b"", b"")] * 10 + [(head[:25], b"")] * 5 + [(head, body)] * 10
        limit = CLIENT_TIMEOUT_MS / 1000 + 2.5
        clients = [
            slow_client(port, first, trickle, limit + 5)
            for port in self.gateway_ports
            for first, trickle in shapes
        ]
        closed = await asyncio.gather(*clients)
        self.tally.slow_clients += len(closed)
        self.tally.slow_clients_not_cut += sum(1 for t in closed if t > limit)

    async def rss_sampler(self) -> None:
        while not self.stop.is_set():
            for name in ("gateway-0", "gateway-1"):
                pid = self.procs[name].proc.pid
                mb = rss_mb(pid)
                if mb:
                    self.tally.rss.setdefault(name, []).append((time.monotonic(), pid, mb))
            await asyncio.sleep(2.0)

    def memory_growth(self) -> dict[str, dict[str, float]]:
        """Per gateway, its longest-lived process's RSS at the end of its warm-up and at its last sample
        (a killed gateway restarts as a new process, which warms up anew)."""
        warmup = min(WARMUP_S, self.seconds / 4)
        out: dict[str, dict[str, float]] = {}
        for name, samples in self.tally.rss.items():
            for pid in {p for _t, p, _mb in samples}:
                mine = [
                    (t, mb) for t, p, mb in samples if p == pid and t >= self.started.get(p, 0.0) + warmup
                ]
                if len(mine) < 2 or mine[-1][0] - mine[0][0] <= out.get(name, {}).get("over_s", 0.0):
                    continue
                out[name] = {"after_warmup_mb": mine[0][1], "end_mb": mine[-1][1],
                             "growth_mb": round(mine[-1][1] - mine[0][1], 1),
                             "over_s": round(mine[-1][0] - mine[0][0], 1)}  # fmt: skip
        return out

    async def quota_enforced(self) -> bool:
        client = aioredis.Redis.from_url(self.primary_url, decode_responses=True)
        try:
            stored = await client.hgetall(quota_key(MODEL))
        finally:
            await client.aclose()
        return stored.get("total") == str(QUOTA)

    async def faults(self, session: aiohttp.ClientSession) -> None:
        start = time.monotonic()
        count = max(6, int(self.seconds // 12))  # CI's 60 s: 6 of the 7 kinds
        order = list(self.kinds)
        self.rng.shuffle(order)
        plan = [order[i % len(order)] for i in range(count)]
        gap = self.seconds / (count + 1)
        for n, kind in enumerate(plan):
            at = start + gap * (n + 1)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if time.monotonic() - start > self.seconds:
                break
            print(f"chaos: {time.monotonic() - start:6.1f} s  fault {kind}", flush=True)
            await self.fault(kind, session)

    # -- run ---------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        rss_start = rss_mb(self.procs["gateway-1"].proc.pid)
        # idle pooled connections close well before the gateways' client timeout, as a client's should
        connector = aiohttp.TCPConnector(keepalive_timeout=1.0)
        async with aiohttp.ClientSession(connector=connector) as session:
            load = [spawn(self.client(session, n), name=f"chaos-client-{n}") for n in range(10)]
            sampler = spawn(self.sampler(session), name="chaos-sampler")
            logs = spawn(self.held_logs(session), name="chaos-held-logs")
            rss = spawn(self.rss_sampler(), name="chaos-rss")
            await self.faults(session)
            self.stop.set()
            await asyncio.gather(*load, sampler, rss)
            await logs
        rss_end = rss_mb(self.procs["gateway-1"].proc.pid)
        await asyncio.sleep(LEASE_MS / 1000 * 1.5)
        client = aioredis.Redis.from_url(self.primary_url)
        try:
            leaked = len(await live_leases(client, MODEL))
        finally:
            await client.aclose()
        t = self.tally
        answered = sum(t.statuses.values())
        duplicated = sum(1 for ids in t.lease_ids.values() if len(ids) > 1)
        memory = self.memory_growth()
        running = max_running(t.held_events)
        return {
            "sent": t.sent,
            "answered_once": answered + t.left,
            "lost": t.lost,
            "duplicated": duplicated,
            "wrongly_rejected": t.wrongly_rejected,
            "status_500": t.statuses.get(500, 0),
            "slots_leaked": leaked,
            "max_quota_overshoot": max(0, running - QUOTA),
            "max_recovery_s": max(t.recoveries, default=0.0),
            "lease_period_s": LEASE_MS / 1000,
            "quota_enforced_after_redis_restart": bool(t.quota_after_restart) and all(t.quota_after_restart),
            "faults": dict(t.faults),
            "lost_why": dict(t.lost_why),
            "statuses": {str(k): v for k, v in sorted(t.statuses.items())},
            "broken_by_gateway_kill": t.broken_expected,
            "broken_by_worker_kill": t.broken_by_worker_kill,
            "clients_left_mid_stream": t.left,
            "recoveries_s": t.recoveries,
            "sampled_quota_overshoot": max(0, t.sampled_overshoot),
            "gateway_rss_mb": {"start": rss_start, "end": rss_end},
            "slow_clients": t.slow_clients,
            "slow_clients_not_cut": t.slow_clients_not_cut,
            "max_memory_growth_mb": max((m["growth_mb"] for m in memory.values()), default=0.0),
            "memory_bound_mb": MEMORY_BOUND_MB,
            "memory": memory,
            "seconds": self.seconds,
            "redis_failure": self.redis_failure,
            "redis_topology": self.topology,
            "failover_s": t.failover_s,  # per failover: primary killed -> replica promoted
            "max_failover_s": max(t.failover_s, default=0.0),  # (max_recovery_s counts from the promotion)
            "max_running": running,
            # what may run at once: the quota; in open mode, + every other gateway's local share
            "running_bound": running_bound(self.redis_failure),
        }


def running_bound(redis_failure: str, gateways: int = 2) -> int:
    """The most requests allowed to run at once: the quota when closed; when open, the worst case of
    docs/REDIS.md (one gateway held the whole quota at the outage, the others add their local share
    floor(total / gateways) on top), total × (2 − 1/gateways) for a total divisible by gateways."""
    if redis_failure == "closed":
        return QUOTA
    return QUOTA + (gateways - 1) * (QUOTA // gateways)


def max_running(events: list[tuple[float, int]]) -> int:
    """The most requests running at once over (time, +1 start | -1 end) events; an end at the same
    instant as a start comes first."""
    running = peak = 0
    for _t, delta in sorted(events):
        running += delta
        peak = max(peak, running)
    return peak


async def slow_client(port: int, first: bytes, trickle: bytes, give_up_s: float) -> float:
    """Seconds until the gateway closes a connection that sent `first`, then `trickle` one byte every
    0.2 s; `give_up_s` if it never does."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0.0  # its gateway is down: nothing held

    async def dribble() -> None:
        with contextlib.suppress(OSError):  # closed by the gateway: the point
            writer.write(first)
            for byte in trickle:
                await asyncio.sleep(0.2)
                writer.write(bytes([byte]))
                await writer.drain()

    sender = spawn(dribble(), name="chaos-slowloris")
    try:
        await asyncio.wait_for(reader.read(), give_up_s)
        return time.monotonic() - start
    except TimeoutError:
        return give_up_s
    except OSError:
        return time.monotonic() - start
    finally:
        sender.cancel()
        writer.close()


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def table(result: dict[str, Any]) -> str:
    rows = [(k, v) for k, v in result.items() if not isinstance(v, dict | list)]
    rows += [(f"faults.{k}", v) for k, v in result["faults"].items()]
    rows += [(f"status.{k}", v) for k, v in result["statuses"].items()]
    for name, m in result["memory"].items():
        rows.append((f"memory.{name}", f"{m['after_warmup_mb']} -> {m['end_mb']} MB over {m['over_s']} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300, help="length of the run (default 300)")
    parser.add_argument("--json", default="", help="write the result here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--faults", default="", help="fault kinds to draw from (default: all of the topology's)"
    )
    parser.add_argument(
        "--redis-topology",
        choices=("standalone", "sentinel"),
        default="standalone",
        help="one redis-server (default), or a primary + replica + sentinel (fault redis_failover)",
    )
    parser.add_argument("--redis-failure", choices=("closed", "open"), default="closed",
                        help='gateway.redis_failure of both gateways (default "closed")')  # fmt: skip
    parser.add_argument("--log-dir", default="", help="process logs (default: a temp dir)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvgate-chaos-"))
    allowed = SENTINEL_KINDS if args.redis_topology == "sentinel" else KINDS
    kinds = tuple(k for k in args.faults.split(",") if k) or allowed
    if set(kinds) - set(allowed):
        parser.error(f"--faults: choose from {','.join(allowed)}")
    chaos = Chaos(args.seconds, args.seed, log_dir, kinds, args.redis_failure, args.redis_topology)
    try:
        chaos.setup()
        result = asyncio.run(chaos.run())
    finally:
        chaos.stack.close()
        if chaos.proxy is not None:
            chaos.proxy.stop()
        if chaos.sentinel is not None:
            chaos.sentinel.stop()
    print(table(result))
    print(f"logs: {log_dir}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
