"""`kvgate bench burst`: a live 2x burst through two gateways sharing one Redis (issue 4's live goal).

Real processes on loopback (bench/stack.py): an embedded Redis, emulated vLLM workers with their
agents, and N gateways whose config caps the model at `workers x per_worker` requests. The bench
then sets the run-time band quota (high may use every seat; low never more than half, so half the
seats stay reserved for high) and runs, through all gateways in turn:

  1. unloaded   high-priority requests alone at a low rate: the reference TTFT and the service time
                (capacity = quota / mean unloaded service time, in requests per second);
  2. load       `--warm-load` x capacity for `--warm-s`, then `--burst-load` x capacity for
                `--burst-s`, mixed high (`--high-share`) and low priority, then quiet until done;
                meanwhile the workers' own in-flight ids are sampled (`/kvgate/inflight`) to find
                the peak number of requests running in the cluster;
  3. leases     one lease period after the last response, the leases still held (Redis);
  4. wake-up    the bench holds every seat itself, sends one high request through a gateway,
                waits until it is queued in Redis, releases one seat and times until a worker
                reports the request in flight (queued-to-running, polling: an upper bound).

Prints a table and writes `{"max_running_over_quota", "slots_held_after", "high_ttft_p99",
"high_ttft_p99_unloaded", "wake_p99", ...}` with `--json`. Goals: never over quota, high TTFT p99
<= 2x unloaded, 0 slots held after, wake p99 <= 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.live_scenarios import filler_text
from bench.loadgen import LiveRequest, LiveResult, percentile, run_open_loop
from bench.stack import Stack
from plugin.decision_log import read_recent
from policy.admission import Quota
from policy.types import Band
from runtime.tasks import spawn
from store.scripts import GRANTED_CHANNEL
from store.slots import AdmissionRejected, Lease, SlotPool, Ticket, live_leases, set_quota

MODEL = "llama"
PROFILE = "h100-llama3.1-8b"
PRIORITY = "x-kvgate-priority"
MAX_WAIT = "x-kvgate-max-wait-ms"


@dataclass(frozen=True)
class BurstConfig:
    gateways: int = 2
    workers: int = 4
    per_worker: int = 3  # quota = workers x per_worker requests
    time_scale: float = 1.0
    max_tokens: int = 128
    prompt_tokens: int = 200
    high_share: float = 0.1
    unloaded_requests: int = 30
    unloaded_rate: float = 2.0
    warm_load: float = 0.5
    warm_s: float = 10.0
    burst_load: float = 2.0
    burst_s: float = 20.0
    low_wait_ms: int = 10_000
    probes: int = 30
    lease_ms: int = 4_000
    aging_ms: int = 5_000  # the admission default; 0 = strict priority
    high_reserve: int = 2  # seats low may never take (quota reserve:2): a high burst finds them free
    # what each agent registers as its worker's max_concurrency (two-step admission's step two):
    # -1 = per_worker (the quota is exactly the workers' places); 0 = unknown (no step two)
    worker_capacity: int = -1
    seed: int = 1

    @property
    def quota(self) -> int:
        return self.workers * self.per_worker


def band_quota(total: int, aging_ms: int = 5_000, reserve: int = 0) -> Quota:
    """High may take every seat; low never more than half (high's nominal), and never the last
    `reserve` free seats, so a high burst beyond its nominal still finds seats without waiting."""
    low = total // 2
    return Quota(total=total, band={Band.HIGH: total - low, Band.LOW: low}, borrow={Band.HIGH: low},
                 reserve={Band.HIGH: reserve}, aging_ms=aging_ms, count_seats=False)  # fmt: skip


def gateway_toml(cfg: BurstConfig) -> str:
    return (
        f"[admission]\nlease_ms = {cfg.lease_ms}\nrenew_every_ms = {cfg.lease_ms // 4}\n"
        f'audit_every_ms = 2000\n\n[models."{MODEL}"]\ntotal = {cfg.quota}\n'
    )


def request(rng: random.Random, cfg: BurstConfig, at_s: float, band: str, rid: str) -> LiveRequest:
    headers = {PRIORITY: band, "x-request-id": rid}
    if band == "low":
        headers[MAX_WAIT] = str(cfg.low_wait_ms)
    text = filler_text(rng, cfg.prompt_tokens)
    body = {"model": MODEL, "max_tokens": cfg.max_tokens, "messages": [{"role": "user", "content": text}]}
    return LiveRequest(send_at_s=at_s, body=body, headers=headers)


def poisson_times(rng: random.Random, rate: float, start_s: float, length_s: float) -> list[float]:
    times: list[float] = []
    t = start_s
    while True:
        t += rng.expovariate(rate)
        if t >= start_s + length_s:
            return times
        times.append(t)


async def run_split(urls: Sequence[str], requests: Sequence[LiveRequest]) -> list[LiveResult]:
    """Send request i through gateway i mod N (open loop); results in request order."""
    shares = [list(requests[i :: len(urls)]) for i in range(len(urls))]
    parts = await asyncio.gather(*(run_open_loop(u, s) for u, s in zip(urls, shares, strict=True)))
    out: list[LiveResult] = [LiveResult(index=-1)] * len(requests)
    for g, part in enumerate(parts):
        for j, result in enumerate(part):
            out[g + j * len(urls)] = result
    return out


async def inflight_ids(session: aiohttp.ClientSession, workers: Sequence[str]) -> list[set[str]]:
    async def one(url: str) -> set[str]:
        async with session.get(f"{url}/kvgate/inflight") as resp:
            return set((await resp.json())["request_ids"])

    return list(await asyncio.gather(*(one(u) for u in workers)))


async def sample_running(workers: Sequence[str], stop: asyncio.Event, every_s: float = 0.02) -> int:
    """Peak of the summed in-flight requests the workers report, sampled until `stop`."""
    peak = 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            peak = max(peak, sum(len(ids) for ids in await inflight_ids(session, workers)))
            await asyncio.sleep(every_s)
    return peak


def admission_wait(gateways: Sequence[str], band: str) -> tuple[float, float]:
    """(mean, upper bound of the p99 bucket) of kvgate_admission_wait_seconds of `band`, all gateways."""
    buckets: dict[float, int] = {}
    total = count = 0.0
    for url in gateways:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if not line.startswith("kvgate_admission_wait_seconds") or f'band="{band}"' not in line:
                    continue
                value = float(line.rsplit(" ", 1)[1])
                if "_bucket" in line:
                    le = line.split('le="', 1)[1].split('"', 1)[0]
                    bound = float("inf") if le == "+Inf" else float(le)
                    buckets[bound] = buckets.get(bound, 0) + int(value)
                elif "_sum" in line:
                    total += value
                elif "_count" in line:
                    count += value
    p99 = next((b for b, n in sorted(buckets.items()) if count and n >= 0.99 * count), float("nan"))
    return (total / count if count else float("nan")), p99


def worker_peaks(workers: Sequence[str]) -> list[int]:
    """Each emulator's own kvgate_emulator_max_concurrent_requests gauge."""
    peaks = []
    for url in workers:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("kvgate_emulator_max_concurrent_requests"):
                    peaks.append(int(float(line.rsplit(" ", 1)[1])))
    return peaks


async def fill_seats(pool: SlotPool, held: list[Lease], prefix: str) -> None:
    """Take seats (low first, then high) until the gate refuses; the bench then holds them all."""
    for band in (Band.LOW, Band.HIGH):
        while True:
            try:
                held.append(
                    await pool.acquire(Ticket(f"{prefix}-{len(held)}", MODEL, band, "bench", max_wait_s=0))
                )
            except AdmissionRejected:
                break


async def send_probe(session: aiohttp.ClientSession, url: str, probe: LiveRequest) -> int:
    async with session.post(f"{url}{probe.path}", json=dict(probe.body), headers=dict(probe.headers)) as resp:
        await resp.read()
        return resp.status


def of_client(lease_id: object, client_id: str) -> bool:
    """The gateway's lease id of the request the client sent as `x-request-id: client_id`."""
    return isinstance(lease_id, str) and lease_id.startswith(client_id + ".")


async def granted(pubsub: Any, rid: str) -> float:
    """When the grant message naming `rid` arrived (what the gateways' SlotPools wake on)."""
    while True:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        if message is not None and any(of_client(i, rid) for i in json.loads(message["data"])):
            return time.perf_counter()


async def wake_probes(stack: Stack, cfg: BurstConfig) -> tuple[list[float], list[float]]:
    """Queued-to-running latency after a seat frees, one sample per probe, alternating gateways:
    (until a worker reports the request in flight, polled: an upper bound; until the grant message
    is published: the Redis share of it)."""
    redis = aioredis.Redis.from_url(stack.redis_url)
    samples: list[float] = []
    gate_samples: list[float] = []
    held: list[Lease] = []
    rng = random.Random(cfg.seed + 7)
    try:
        pool = SlotPool(redis, gateway_id="bench-holder", lease_ms=30_000, renew_every_ms=5_000)
        pubsub = redis.pubsub()
        await pubsub.subscribe(GRANTED_CHANNEL)
        async with pool, aiohttp.ClientSession() as session:
            for i in range(cfg.probes):
                # the previous probe's gateway releases its seat after the response: wait for it, or
                # that release (not ours) would wake the next probe
                while (await pool.snapshot(MODEL))["used"]["total"] > len(held):
                    await asyncio.sleep(0.002)
                await fill_seats(pool, held, f"hold{i}")
                rid = f"probe-{i}"
                probe = request(rng, cfg, 0.0, "high", rid)
                probe = LiveRequest(0.0, dict(probe.body, max_tokens=4), probe.headers)
                url = stack.gateway_urls[i % len(stack.gateway_urls)]
                sent = spawn(send_probe(session, url, probe), name=rid)
                while (await pool.snapshot(MODEL))["queued"]["high"] < 1:
                    await asyncio.sleep(0.002)
                freed = next(lease for lease in reversed(held) if lease.band == Band.HIGH)
                held.remove(freed)
                start = time.perf_counter()
                grant = spawn(granted(pubsub, rid), name=f"grant-{rid}")
                await pool.release(freed)
                while not any(
                    of_client(i, rid) for ids in await inflight_ids(session, stack.worker_urls) for i in ids
                ):
                    if time.perf_counter() - start > 10:
                        raise RuntimeError(f"{rid} never reached a worker")
                samples.append(time.perf_counter() - start)
                gate_samples.append(await grant - start)
                await sent
            for lease in held:
                await pool.release(lease)
    finally:
        await redis.aclose()
    return samples, gate_samples


async def leases_after(stack: Stack, cfg: BurstConfig) -> int:
    await asyncio.sleep(cfg.lease_ms / 1000)
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        return len(await live_leases(redis, MODEL))
    finally:
        await redis.aclose()


async def queued_s(stack: Stack, request_ids: set[str]) -> tuple[list[float], dict[str, int]]:
    """Admission wait (s) of `request_ids` and how many of them each admission step held (`held_by`:
    "" at once, "quota" waited for a seat, "worker" a chosen worker was full), from the gateways'
    decision stream (kvg:decisions)."""
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        records = await read_recent(redis, count=100_000)
    finally:
        await redis.aclose()
    mine = [r for r in records if r.get("client_request_id") in request_ids]
    held_by = Counter(str(r.get("held_by") or "") for r in mine)
    return [float(r["queued_ms"]) / 1000 for r in mine], dict(held_by)


async def set_band_quota(stack: Stack, cfg: BurstConfig) -> None:
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        await set_quota(redis, MODEL, band_quota(cfg.quota, cfg.aging_ms, cfg.high_reserve))
    finally:
        await redis.aclose()


def ttfts(results: Sequence[LiveResult]) -> list[float]:
    return [r.ttft_s for r in results if r.ok and r.ttft_s is not None]


async def run(stack: Stack, cfg: BurstConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    await asyncio.sleep(1.5)  # let every gateway write its config quota first, then change it at run time
    await set_band_quota(stack, cfg)
    unloaded_reqs = [
        request(rng, cfg, i / cfg.unloaded_rate, "high", f"u{i}") for i in range(cfg.unloaded_requests)
    ]
    unloaded = await run_split(stack.gateway_urls, unloaded_reqs)
    service_s = sum(r.e2e_s or 0.0 for r in unloaded if r.ok) / max(1, sum(r.ok for r in unloaded))
    capacity_rps = cfg.quota / service_s
    arrivals = poisson_times(rng, cfg.warm_load * capacity_rps, 0.0, cfg.warm_s)
    burst_times = poisson_times(rng, cfg.burst_load * capacity_rps, cfg.warm_s, cfg.burst_s)
    load = [
        request(rng, cfg, t, "high" if rng.random() < cfg.high_share else "low", f"l{i}")
        for i, t in enumerate([*arrivals, *burst_times])
    ]
    stop = asyncio.Event()
    sampler = spawn(sample_running(stack.worker_urls, stop), name="burst-sampler")
    results = await run_split(stack.gateway_urls, load)
    stop.set()
    peak_sampled = await sampler
    held_after = await leases_after(stack, cfg)
    high_wait = admission_wait([stack.metrics_urls[u] for u in stack.gateway_urls], "high")
    high_burst_ids = {
        str(q.headers["x-request-id"])
        for q in load
        if q.send_at_s >= cfg.warm_s and q.headers[PRIORITY] == "high"
    }
    high_queued, high_held_by = await queued_s(stack, high_burst_ids)
    wakes, gate_wakes = await wake_probes(stack, cfg)
    in_burst = [r for q, r in zip(load, results, strict=True) if q.send_at_s >= cfg.warm_s]
    high_burst = [
        r
        for q, r in zip(load, results, strict=True)
        if q.send_at_s >= cfg.warm_s and q.headers[PRIORITY] == "high"
    ]
    low = [r for q, r in zip(load, results, strict=True) if q.headers[PRIORITY] == "low"]
    peaks = worker_peaks(stack.worker_urls)
    return {
        "max_running_over_quota": max(0, peak_sampled - cfg.quota),
        "slots_held_after": held_after,
        "high_ttft_p99": percentile(ttfts(high_burst), 99),
        "high_ttft_p99_unloaded": percentile(ttfts(unloaded), 99),
        "wake_p99": percentile(wakes, 99),
        "wake_p50": percentile(wakes, 50),
        "wake_grant_p50": percentile(gate_wakes, 50),
        "wake_grant_p99": percentile(gate_wakes, 99),
        "high_admission_wait_mean": high_wait[0],
        "high_admission_wait_p99_le": high_wait[1],
        "high_burst_queued_p99": percentile(high_queued, 99),
        "high_burst_queued_max": max(high_queued, default=float("nan")),
        "high_burst_held_by": high_held_by,
        "load_average_1m": os.getloadavg()[0],
        "quota": cfg.quota,
        "peak_running_sampled": peak_sampled,
        "sum_of_worker_peaks": sum(peaks),
        "capacity_rps": capacity_rps,
        "service_s_unloaded": service_s,
        "requests": len(load),
        "burst_requests": len(in_burst),
        "high_burst_requests": len(high_burst),
        "high_burst_errors": sum(not r.ok for r in high_burst),
        "high_ttft_p50": percentile(ttfts(high_burst), 50),
        "low_completed": sum(r.ok for r in low),
        "low_rejected": sum(r.status == 429 for r in low),
        "other_errors": sum(not r.ok and r.status != 429 for r in results),
        "config": asdict(cfg),
    }


def start_stack(stack: Stack, cfg: BurstConfig, work_dir: Path) -> None:
    stack.start_redis()
    for i in range(cfg.workers):
        url = stack.start_worker(f"w{i}", model=MODEL, profile=PROFILE, time_scale=cfg.time_scale)
        capacity = cfg.per_worker if cfg.worker_capacity < 0 else cfg.worker_capacity
        stack.start_agent(f"w{i}", url, model=MODEL, extra=["--max-concurrency", str(capacity)])
    config = work_dir / "gateway.toml"
    config.write_text(gateway_toml(cfg))
    for g in range(cfg.gateways):
        stack.start_gateway(f"g{g}", config=config, extra=["--gateway-id", f"g{g}"])


def print_table(report: dict[str, Any]) -> None:
    def ms(key: str) -> str:
        return f"{float(report[key]) * 1000:.1f} ms"

    wait_le = report["high_admission_wait_p99_le"]
    rows = [
        ("quota (requests)", str(report["quota"]), ""),
        ("peak running (sampled)", str(report["peak_running_sampled"]), "<= quota"),
        ("sum of per-worker peaks", str(report["sum_of_worker_peaks"]), "(upper bound, not simultaneous)"),
        ("max running over quota", str(report["max_running_over_quota"]), "goal 0"),
        ("slots held after", str(report["slots_held_after"]), "goal 0"),
        ("high TTFT p99 unloaded", ms("high_ttft_p99_unloaded"), ""),
        ("high TTFT p50/p99 burst", f"{ms('high_ttft_p50')} / {ms('high_ttft_p99')}", "goal <= 2x unloaded"),
        ("wake-up p50 / p99", f"{ms('wake_p50')} / {ms('wake_p99')}", "goal p99 <= 50 ms (to worker)"),
        ("  grant message p50/p99", f"{ms('wake_grant_p50')} / {ms('wake_grant_p99')}", "release -> pub/sub"),
        ("high admission wait mean", ms("high_admission_wait_mean"), f"p99 <= {wait_le} s (all phases)"),
        ("high queued p99 / max burst", f"{ms('high_burst_queued_p99')} / {ms('high_burst_queued_max')}",
         f"decision stream; reserve {report['config']['high_reserve']}"),
        ("high held by: none/quota/worker", "/".join(str(report["high_burst_held_by"].get(k, 0))
                                                     for k in ("", "quota", "worker")), "two-step admission"),
        ("load average (1 min)", f"{report['load_average_1m']:.1f}", "2 cores"),
        ("capacity", f"{report['capacity_rps']:.1f} req/s", "quota / unloaded service time"),
        ("requests: all / burst / high", f"{report['requests']} / {report['burst_requests']} / "
         f"{report['high_burst_requests']}", ""),
        ("low completed / 429", f"{report['low_completed']} / {report['low_rejected']}", ""),
        ("other errors", str(report["other_errors"]), ""),
    ]  # fmt: skip
    for name, value, note in rows:
        print(f"{name:<28} {value:>22}  {note}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench burst", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    defaults = BurstConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--logs", type=Path, help="keep process logs here (default: a temporary directory)")
    args = vars(parser.parse_args(argv))
    json_path, logs = args.pop("json"), args.pop("logs")
    cfg = BurstConfig(**args)
    with tempfile.TemporaryDirectory(prefix="kvgate-burst-") as tmp:
        work_dir = logs or Path(tmp)
        with Stack(log_dir=work_dir) as stack:
            print(
                f"starting Redis, {cfg.workers} workers with agents, {cfg.gateways} gateways ...",
                file=sys.stderr,
            )
            start_stack(stack, cfg, work_dir)
            report = asyncio.run(run(stack, cfg))
    print_table(report)
    if json_path:
        json_path.write_text(json.dumps(report, indent=2))
    return 0 if report["max_running_over_quota"] == 0 and report["slots_held_after"] == 0 else 1
