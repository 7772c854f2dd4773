"""Admission throughput on one Redis against a Redis Cluster of 1 and 3 masters (issue 11, item 6).

    python -m bench.cluster_scale [--models 6] [--clients 2] [--concurrency 32] [--seconds 5] [--json PATH]

For each backend (the standalone embedded server, through the gateway's own fast path; a 1-master
and a 3-master cluster from the same binary, through redis-py's cluster client) it writes an unlimited
quota for `--models` models, then runs `--clients` client processes, each with `--concurrency` loops of
acquire + release (the two admission scripts every request costs, store/scripts.py) on requests
spread evenly over the models, for `--seconds`. Prints admissions per second, and per master: its
share of the scripts and its CPU (INFO cpu, during the run). The busiest master's CPU per admission
is what caps a backend: on a cluster it is the hottest model's master, so models spread the work only
as evenly as their hash tags spread over the masters (`{model}`, docs/REDIS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import multiprocessing
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from policy.admission import Quota
from policy.types import Band
from store import keys
from store.connect import redis_from_url
from store.redis_cluster import EmbeddedRedisCluster, slot_ranges
from store.redis_server import EmbeddedRedis
from store.scripts import register_scripts
from store.slots import set_quota

BACKENDS = ("standalone", "cluster-1", "cluster-3")


def spread_models(n: int, masters: int = 3) -> list[str]:
    """`n` model names whose hash tags fall on the masters of a `masters`-node cluster in turn, so a
    run with n >= masters loads every master (names are model-0, model-1, ... skipping the rest)."""
    ranges = slot_ranges(masters)
    chosen: list[str] = []
    i = 0
    while len(chosen) < n:
        name = f"model-{i}"
        slot = key_slot(keys.model_key(name).encode())
        if slot in ranges[len(chosen) % masters]:
            chosen.append(name)
        i += 1
    return chosen


async def _drive(
    url: str, models: Sequence[str], concurrency: int, seconds: float, tag: str
) -> tuple[int, list[str]]:
    """(admissions done, errors) of `concurrency` acquire+release loops for `seconds`."""
    client = redis_from_url(url)
    scripts = register_scripts(client)
    done = 0
    failed: list[str] = []
    stop_at = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop_at:
            model = models[(k + i) % len(models)]
            rid = f"{tag}-{k}-{i}"
            try:
                await scripts.acquire(model, rid, Band.NORMAL, "t", 1, 10_000, 0, tag)
                await scripts.release(model, rid)
                done += 1
            except Exception as e:  # counted and shown, not hidden (docs/REDIS.md, Cluster)
                failed.append(f"{type(e).__name__}: {e}")
            i += 1

    try:
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
    finally:
        await scripts.aclose()
        await client.aclose()
    return done, failed


def _client(args: tuple[str, list[str], int, float, str, Any]) -> None:
    url, models, concurrency, seconds, tag, queue = args
    faulthandler.dump_traceback_later(seconds + 60, exit=True)  # a hung client shows where it hangs
    try:
        queue.put(asyncio.run(_drive(url, models, concurrency, seconds, tag)))
    except BaseException as e:
        queue.put(e)
        raise


def _node_stats(ports: Sequence[int]) -> list[dict[str, float]]:
    out = []
    for port in ports:
        client = redis.Redis(port=port)
        cpu = client.info("cpu")
        calls = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        out.append(
            {"cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), "evalsha": float(calls)}
        )
        client.close()
    return out


def measure(
    backend: str, models: Sequence[str], clients: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    server: EmbeddedRedis | EmbeddedRedisCluster
    if backend == "standalone":
        server = EmbeddedRedis().start()
        url, ports = server.url, [server.port]
    else:
        server = EmbeddedRedisCluster(int(backend.split("-")[1])).start()
        url, ports = server.url, server.ports
    try:

        async def quotas() -> None:
            client = redis_from_url(url)
            for model in models:
                await set_quota(client, model, Quota())
            await register_scripts(client).snapshot(models[0])  # loads the scripts before timing
            await client.aclose()

        asyncio.run(quotas())
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        before = _node_stats(ports)
        procs = [
            ctx.Process(target=_client, args=((url, list(models), concurrency, seconds, f"c{i}", queue),))
            for i in range(clients)
        ]
        started = time.perf_counter()
        for p in procs:
            p.start()
        done = [queue.get(timeout=seconds + 90) for _ in procs]
        if errors := [d for d in done if isinstance(d, BaseException)]:
            raise RuntimeError(f"a client failed: {errors[0]!r}")
        total = sum(n for n, _ in done)
        failures = [e for _, errors in done for e in errors]
        for p in procs:
            p.join()
        wall = time.perf_counter() - started
        after = _node_stats(ports)
    finally:
        server.stop()
    cpu = [a["cpu_s"] - b["cpu_s"] for a, b in zip(after, before, strict=True)]
    calls = [a["evalsha"] - b["evalsha"] for a, b in zip(after, before, strict=True)]
    return {
        "backend": backend,
        "masters": len(ports),
        "admissions": total,
        "errors": len(failures),
        "first_error": failures[0] if failures else None,
        "admissions_per_s": total / seconds,
        "wall_s": wall,
        "script_share": [c / sum(calls) if sum(calls) else 0.0 for c in calls],
        "master_cpu_s": cpu,
        "busiest_master_cpu_us_per_admission": max(cpu) / total * 1e6 if total else 0.0,
        "ceiling_admissions_per_s": total / max(cpu) if max(cpu) > 0 else 0.0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster_scale", description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated: {', '.join(BACKENDS)}")
    p.add_argument("--models", type=int, default=6)
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--concurrency", type=int, default=32, help="acquire+release loops per client")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    models = spread_models(args.models)
    rows = []
    for backend in [b for b in args.backends.split(",") if b]:
        if backend not in BACKENDS:
            p.error(f"unknown backend {backend!r}")
        row = measure(backend, models, args.clients, args.concurrency, args.seconds)
        rows.append(row)
        print(
            f"{backend:10s} {row['admissions_per_s']:8.0f} admissions/s  script share per master "
            f"{' '.join(f'{s:.2f}' for s in row['script_share'])}  master CPU s "
            f"{' '.join(f'{c:.2f}' for c in row['master_cpu_s'])}  busiest master "
            f"{row['busiest_master_cpu_us_per_admission']:.0f} us/admission "
            f"(ceiling {row['ceiling_admissions_per_s']:.0f}/s)  errors {row['errors']}"
            + (f" (first: {row['first_error']})" if row["first_error"] else ""),
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"models": models, "clients": args.clients, "concurrency": args.concurrency, "runs": rows}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
