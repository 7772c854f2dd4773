"""`kvgate bench scale`: how the gateway's costs grow with workers, index size and processes.

    kvgate bench scale [--json PATH] [--workers 8,100,1000] [--entries 10000,1000000,10000000]
                       [--decisions 2000] [--processes 1,2,4] [--seconds 6] [--concurrency 32]

1. Decision time: the gateway's own `Router.choose` (plugin/routing.py: mirror views, prefix match,
   the kvgate policy) over W registered workers whose mirrored prefix index holds E block entries
   (chains of 32 blocks, spread evenly), for requests that extend a known chain (hits) and new ones
   (misses), alternately. p50/p99 of the wall time of one decision, in this process, plus the
   resident memory the mirror's index took (RSS before and after filling it).
2. Redis, on a real redis-server: the bytes one registered worker takes (its registry hash and set
   member: `used_memory` before and after registering `--redis-workers` of them, divided) and per
   index entry; then a `kvgate proxy` in front of an instant upstream serves `--requests` requests and
   `INFO commandstats` / `INFO stats` give the commands (round trips counted as commands; a pipeline
   or script is one trip but its commands are counted, see `trips`) and bytes per request, less what
   the same gateway sends while idle for the same time (registry refresh, index tail, heartbeats).
3. Throughput: `kvgate proxy --processes n` (SO_REUSEPORT, one Redis) for each n, a closed loop of
   `--concurrency` keep-alive clients for `--seconds`; with the CPU time the gateway processes and
   this load generator used, since on a small machine the client competes with the gateways.

Output JSON (the interface other tools read): {"decision": [{"workers", "index_entries", "p50",
"p99", ...}], "processes": [{"n", "rps", ...}], "redis_bytes_per_worker", "round_trips_per_request",
...}; seconds for times.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis as redis_sync

from bench.loadgen import percentile
from bench.stack import Stack, kvgate_command, stop_process, wait_http_ok
from plugin.config import RoutingSection
from plugin.flow import Prompt
from plugin.routing import Router
from policy.types import Band
from store.redis_server import free_port
from store.registry import WorkerRecord

MODEL = "bench-model"
CHAIN_BLOCKS = 32  # blocks per synthetic prompt chain in the mirrored index
BLOCK_TOKENS = 64  # tokens per block of the synthetic prompts


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fleet(n: int, capacity_blocks: int) -> list[WorkerRecord]:
    return [
        WorkerRecord(
            id=f"w{i:04d}",
            model=MODEL,
            url=f"http://10.0.{i // 250}.{i % 250}:8000",
            max_concurrency=64,
            capacity_tokens=capacity_blocks * BLOCK_TOKENS,
            running=i % 7,
            waiting=i % 3,
            kv_usage=(i % 10) / 10,
            joined_ms=1,
        )
        for i in range(n)
    ]


def decision_point(
    workers: int, entries: int, decisions: int, seed: int = 1, candidates_limit: int = 0
) -> dict[str, Any]:
    """p50/p99 of one `Router.choose` with `workers` workers and `entries` mirrored index entries."""
    rng = random.Random(seed)
    per_worker = max(CHAIN_BLOCKS, entries // workers)
    # the index is sized in blocks per token of the section's chunking; give each worker room for its share
    section = RoutingSection(candidates_limit=candidates_limit) if candidates_limit else RoutingSection()
    router = Router(section)
    routing = router.model(MODEL)
    capacity_tokens = int(2 * per_worker / routing.blocks_per_token)
    records = fleet(workers, capacity_tokens // BLOCK_TOKENS)
    routing.size_index(records)  # sizes each worker's LRU
    gc.collect()
    before = rss_bytes()
    chains: list[list[int]] = []
    now = time.monotonic()
    filled = 0
    c = 0
    while filled < entries:
        chain = [rng.getrandbits(63) for _ in range(CHAIN_BLOCKS)]
        routing.state.index.insert(records[c % workers].id, chain, now)
        chains.append(chain)
        filled += CHAIN_BLOCKS
        c += 1
    gc.collect()
    index_bytes = rss_bytes() - before
    block_tokens = [BLOCK_TOKENS] * (CHAIN_BLOCKS + 4)
    times: list[float] = []
    for i in range(decisions):
        if i % 2 == 0:
            hashes = [*rng.choice(chains), *(rng.getrandbits(63) for _ in range(4))]
        else:
            hashes = [rng.getrandbits(63) for _ in range(CHAIN_BLOCKS + 4)]
        prompt = Prompt(tuple(hashes), tuple(block_tokens), sum(block_tokens))
        started = time.perf_counter()
        route = router.choose(request_id=f"r{i}", model=MODEL, prompt=prompt, max_tokens=64,
                              band=Band.NORMAL, tenant="t", workers=records)  # fmt: skip
        times.append(time.perf_counter() - started)
        assert route is not None
    return {"workers": workers, "index_entries": filled, "p50": percentile(times, 50),
            "p99": percentile(times, 99), "mirror_rss_bytes": index_bytes,
            "mirror_bytes_per_entry": index_bytes / filled}  # fmt: skip


# -- Redis ------------------------------------------------------------------------------------------


def redis_memory_per_worker(url: str, workers: int) -> dict[str, float]:
    """used_memory per registered worker (registry) and per index entry, on a real redis-server."""
    from store import index_store, registry

    async def run() -> dict[str, float]:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        try:
            await client.flushdb()
            used0 = int((await client.info("memory"))["used_memory"])
            now_ms = int(time.time() * 1000)
            for record in fleet(workers, 4096):
                await registry.register(client, record, 60_000, now_ms)
            used1 = int((await client.info("memory"))["used_memory"])
            rng = random.Random(2)
            blocks = 0
            for record in fleet(workers, 4096)[: min(workers, 20)]:
                for _ in range(10):
                    chain = [rng.getrandbits(63) for _ in range(CHAIN_BLOCKS)]
                    await index_store.add_blocks(client, MODEL, record.id, chain, now_ms)
                    blocks += CHAIN_BLOCKS
            used2 = int((await client.info("memory"))["used_memory"])
            await client.flushdb()
            return {"redis_bytes_per_worker": (used1 - used0) / workers,
                    "redis_bytes_per_index_entry": (used2 - used1) / blocks,
                    "redis_index_entries_measured": blocks}  # fmt: skip
        finally:
            await client.aclose()

    return asyncio.run(run())


def redis_counters(client: redis_sync.Redis) -> tuple[int, int]:
    """(commands processed, network bytes in + out) of the server so far."""
    stats = client.info("stats")
    return int(stats["total_commands_processed"]), int(stats["total_net_input_bytes"]) + int(
        stats["total_net_output_bytes"]
    )


def command_counts(client: redis_sync.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in client.info("commandstats").items()}


class MonitorCount:
    """Commands clients sent (round trips; a pipeline's commands count one each) and commands run inside
    scripts, from MONITOR on a connection of its own, in a thread."""

    def __init__(self, url: str) -> None:
        self.client = redis_sync.Redis.from_url(url, socket_timeout=0.5)
        self.top = self.lua = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> MonitorCount:
        self.thread.start()
        time.sleep(0.2)
        return self

    def _run(self) -> None:
        with self.client.monitor() as m:
            while not self.done.is_set():
                try:
                    cmd = m.next_command()
                except (redis_sync.TimeoutError, redis_sync.ConnectionError):
                    continue
                if cmd.get("client_type") == "lua":
                    self.lua += 1
                else:
                    self.top += 1

    def stop(self) -> tuple[int, int]:
        self.done.set()
        self.thread.join(5)
        self.client.close()
        return self.top, self.lua


def idle_top_rate(idle_rate: float, commands: int, top: int) -> float:
    """The idle command rate scaled to client commands (the idle share is assumed alike in both)."""
    return idle_rate * top / commands if commands else 0.0


def redis_per_request(stack: Stack, gateway_url: str, requests: int, body: dict[str, Any]) -> dict[str, Any]:
    """Commands and bytes per request through one gateway, less its idle traffic over the same time."""
    import urllib.request

    client = redis_sync.Redis.from_url(stack.redis_url)
    time.sleep(1.0)  # past the start-up reads
    idle_s = 2.0
    c0, b0 = redis_counters(client)
    time.sleep(idle_s)
    c1, b1 = redis_counters(client)
    idle_cmd_rate, idle_byte_rate = (c1 - c0) / idle_s, (b1 - b0) / idle_s
    client.config_resetstat()
    trips = MonitorCount(stack.redis_url).start()
    c0, b0 = redis_counters(client)
    data = json.dumps(body).encode()
    started = time.perf_counter()
    for _ in range(requests):  # one at a time: every request's own commands, no batching across requests
        req = urllib.request.Request(f"{gateway_url}/v1/chat/completions", data=data,
                                     headers={"content-type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
    time.sleep(0.3)  # the batched index write and the release land
    elapsed = time.perf_counter() - started
    c1, b1 = redis_counters(client)
    top, in_scripts = trips.stop()
    counts = command_counts(client)
    client.close()
    cmds = max(0.0, (c1 - c0) - idle_cmd_rate * elapsed) / requests
    round_trips = max(0.0, top - idle_top_rate(idle_cmd_rate, c1 - c0, top) * elapsed) / requests
    sent = max(0.0, (b1 - b0) - idle_byte_rate * elapsed) / requests
    by_name = {k: v / requests for k, v in sorted(counts.items())}  # idle traffic included
    return {
        "round_trips_per_request": round_trips,
        "commands_per_request": cmds,
        "script_commands_per_request": in_scripts / requests,
        "redis_bytes_per_request": sent,
        "redis_idle_commands_per_s": idle_cmd_rate,
        "redis_commands_by_name_per_request": by_name,
    }


# -- processes --------------------------------------------------------------------------------------


def cpu_seconds_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


def child_pids(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def processes_point(n: int, redis_url: str, upstream_url: str, config: Path, args: argparse.Namespace,
                    log_dir: Path) -> dict[str, Any]:  # fmt: skip
    from bench.overhead import make_body, saturation_rps

    port = free_port()
    cmd = kvgate_command("proxy", "--processes", str(n), "--listen-port", str(port), "--redis", redis_url,
                         "--config", str(config), "--worker", upstream_url, "--model", MODEL,
                         "--gateway-id", f"scale{n}")  # fmt: skip
    with (log_dir / f"gateway-x{n}.log").open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/readyz", 60, proc)
        deadline = time.monotonic() + 30
        while len(child_pids(proc.pid)) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # every child up and ready
        pids = [proc.pid, *child_pids(proc.pid)] if n > 1 else [proc.pid]
        rng = random.Random(7)
        system = "s " * 2000
        gw0, me0, wall0 = cpu_seconds_of(pids), os.times(), time.perf_counter()
        rps = asyncio.run(saturation_rps(url, lambda i: make_body(rng, system, i, stream=False),
                                         concurrency=args.concurrency, duration_s=args.seconds))  # fmt: skip
        wall = time.perf_counter() - wall0
        me1 = os.times()
        gw_cpu = cpu_seconds_of(pids) - gw0
        client_cpu = (me1.user - me0.user) + (me1.system - me0.system)
        return {"n": n, "rps": rps, "gateway_cpu_util": gw_cpu / wall, "client_cpu_util": client_cpu / wall,
                "rps_per_gateway_cpu_s": rps * wall / gw_cpu if gw_cpu else None}  # fmt: skip
    finally:
        stop_process(proc, 30)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--workers", default="8,100,1000", help="comma-separated worker counts")
    parser.add_argument("--entries", default="10000,1000000,10000000", help="comma-separated index sizes")
    parser.add_argument("--decisions", type=int, default=2000, help="timed decisions per point")
    parser.add_argument(
        "--candidates-limit", type=int, default=0,
        help="routing.candidates_limit for the decision points (0: the default; 100000: score every worker)",
    )  # fmt: skip
    parser.add_argument("--processes", default="1,2,4", help="comma-separated gateway process counts")
    parser.add_argument("--seconds", type=float, default=6.0, help="closed loop per process count")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--redis-workers", type=int, default=200, help="workers registered for memory")
    parser.add_argument("--requests", type=int, default=200, help="requests counted for round trips")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"decision": [], "processes": []}
    for entries in (int(x) for x in args.entries.split(",")):
        for workers in (int(x) for x in args.workers.split(",")):
            point = decision_point(workers, entries, args.decisions, candidates_limit=args.candidates_limit)
            report["decision"].append(point)
            print(f"decision: {workers:>5} workers {point['index_entries']:>9} entries  p50 "
                  f"{point['p50'] * 1e3:.3f} ms  p99 {point['p99'] * 1e3:.3f} ms  mirror "
                  f"{point['mirror_rss_bytes'] / 2**20:.0f} MiB "
                  f"({point['mirror_bytes_per_entry']:.0f} B/entry)",
                  flush=True)  # fmt: skip
            gc.collect()
    with tempfile.TemporaryDirectory(prefix="kvgate-scale-") as tmp, Stack(log_dir=Path(tmp)) as stack:
        stack.start_redis()
        report |= redis_memory_per_worker(stack.redis_url, args.redis_workers)
        up_port = free_port()
        upstream = stack.spawn(
            "upstream", [sys.executable, "-m", "bench.echo_upstream", "--port", str(up_port)]
        )
        upstream_url = f"http://127.0.0.1:{up_port}"
        wait_http_ok(f"{upstream_url}/health", 20, upstream.proc)
        config = Path(tmp) / "kvgate.toml"
        config.write_text(f'[models."{MODEL}"]\n\n[admission]\ndefault_total = 100000\n')
        gateway = stack.start_gateway("rt", config=config, extra=["--worker", upstream_url, "--model", MODEL])
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 400}], "max_tokens": 8}
        report |= redis_per_request(stack, gateway, args.requests, body)
        stack.stop_process("gateway-rt")
        print(f"redis: {report['redis_bytes_per_worker']:.0f} B per registered worker, "
              f"{report['redis_bytes_per_index_entry']:.0f} B per index entry; per request "
              f"{report['round_trips_per_request']:.2f} round trips "
              f"({report['commands_per_request']:.1f} commands incl. scripts'), "
              f"{report['redis_bytes_per_request']:.0f} B "
              f"(idle: {report['redis_idle_commands_per_s']:.1f} commands/s)", flush=True)  # fmt: skip
        for n in (int(x) for x in args.processes.split(",") if x):
            point = processes_point(n, stack.redis_url, upstream_url, config, args, Path(tmp))
            report["processes"].append(point)
            print(f"processes: {n}  {point['rps']:.0f} req/s  gateway CPU "
                  f"{point['gateway_cpu_util']:.2f} cores, "
                  f"client CPU {point['client_cpu_util']:.2f} cores", flush=True)  # fmt: skip
    base = next((p["rps"] for p in report["processes"] if p["n"] == 1), None)
    for p in report["processes"]:
        p["speedup_vs_1"] = p["rps"] / base if base else None
    report["machine_cores"] = os.cpu_count()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
