"""`kvgate top`: a live terminal view of the fleet, refreshed every second (rich).

    kvgate top [--redis URL] [--interval 1.0] [--once]

Reads only Redis, as every gateway does: the worker registry (lease, draining, in flight, KV usage),
each model's admission snapshot (seats used against the quota, queue length per band, the expected
queue wait that is the autoscaling signal) and the newest decision records (per-worker share of
traffic and measured prefix-cache hit rate over them, and the last few decisions). `--once` prints
one frame and exits (for scripts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from plugin.decision_log import STREAM_KEY
from policy.admission import estimated_wait_s
from store import registry
from store.registry import WorkerRecord
from store.scripts import register_scripts

RECENT = 500  # decision records the share and hit columns are computed over
LAST = 8  # decisions listed


@dataclass(frozen=True)
class Frame:
    """Everything one refresh shows (read from Redis, then drawn)."""

    at_ms: int
    workers: dict[str, list[WorkerRecord]]  # model -> workers
    snapshots: dict[str, dict[str, Any]]  # model -> admission snapshot
    records: list[dict[str, Any]]  # newest first


async def read_frame(redis: aioredis.Redis) -> Frame:
    now_ms = int(time.time() * 1000)
    scripts = register_scripts(redis)
    workers: dict[str, list[WorkerRecord]] = {}
    snapshots: dict[str, dict[str, Any]] = {}
    for model in await registry.list_models(redis):
        workers[model] = await registry.read_workers(redis, model, now_ms)
        snap = await scripts.snapshot(model)
        queued = sum(snap["queued"].values())
        total = int(snap["quota"].get("total", -1))
        snap["est_wait_s"] = estimated_wait_s(queued, total, snap["hold_ms"] / 1000) if queued else 0.0
        snapshots[model] = snap
    records = []
    for _, fields in await redis.xrevrange(STREAM_KEY, count=RECENT) or []:
        raw = (fields or {}).get(b"record") or (fields or {}).get("record")
        if raw is not None:
            records.append(json.loads(raw))
    return Frame(now_ms, workers, snapshots, records)


def worker_stats(records: Sequence[Mapping[str, Any]]) -> tuple[Counter[str], dict[str, float]]:
    """(requests per worker, measured hit rate per worker) over `records`."""
    share: Counter[str] = Counter()
    cached: Counter[str] = Counter()
    prompt: Counter[str] = Counter()
    for r in records:
        w = r.get("worker")
        if not w:
            continue
        share[w] += 1
        if r.get("prompt_tokens") and r.get("cached_tokens") is not None:
            cached[w] += int(r["cached_tokens"])
            prompt[w] += int(r["prompt_tokens"])
    return share, {w: cached[w] / prompt[w] for w in prompt if prompt[w]}


def render(frame: Frame) -> Group:
    share, hit = worker_stats(frame.records)
    routed = sum(share.values())
    stamp = time.strftime("%H:%M:%S UTC", time.gmtime(frame.at_ms / 1000))
    title = Text(f"kvgate top  {stamp}  ({len(frame.records)} recent decisions)", style="bold")
    workers = Table(title="Workers", expand=True)
    for column in ("model", "worker", "lease", "draining", "in flight", "waiting", "KV used", "hit", "share"):
        workers.add_column(column, justify="left" if column in ("model", "worker") else "right")
    for model, records in sorted(frame.workers.items()):
        for w in sorted(records, key=lambda w: w.id):
            lease_s = (w.lease_expiry_ms - frame.at_ms) / 1000
            lease = f"{lease_s:.1f}s" if w.live else "EXPIRED"
            workers.add_row(
                model, w.id, lease, "yes" if w.draining else "-", str(w.running), str(w.waiting),
                f"{w.kv_usage:.0%}", f"{hit[w.id]:.0%}" if w.id in hit else "-",
                f"{share[w.id] / routed:.0%}" if routed else "-",
            )  # fmt: skip
    queues = Table(title="Queues, quotas and the autoscaling signal", expand=True)
    for column in ("model", "high", "normal", "low", "seats used", "quota", "expected wait"):
        queues.add_column(column, justify="left" if column == "model" else "right")
    for model, snap in sorted(frame.snapshots.items()):
        q = snap["queued"]
        total = snap["quota"].get("total", "-")
        queues.add_row(
            model, str(q.get("high", 0)), str(q.get("normal", 0)), str(q.get("low", 0)),
            str(snap["used"]["total"]), str(total), f"{snap['est_wait_s']:.2f}s",
        )  # fmt: skip
    last = Table(title="Last decisions", expand=True)
    for column in ("time", "status", "tenant", "band", "arm", "worker", "queued", "ttft", "why"):
        last.add_column(column, overflow="ellipsis", no_wrap=True)
    for r in frame.records[:LAST]:
        at = time.strftime("%H:%M:%S", time.gmtime(float(r.get("arrival_ms") or 0) / 1000))
        why = str(r.get("reason") or "")
        if r.get("worker") is None:
            why = f"refused ({r.get('refused_by')}): {why}"
        last.add_row(
            at, str(r.get("status")), str(r.get("tenant") or "-"), str(r.get("band")), str(r.get("arm", "")),
            str(r.get("worker") or "-"), f"{float(r.get('queued_ms') or 0):.0f}ms",
            f"{float(r['ttft_ms']):.0f}ms" if "ttft_ms" in r else "-", why,
        )  # fmt: skip
    return Group(title, workers, queues, last)


async def run(url: str, interval_s: float, once: bool, console: Console) -> None:
    from store.connect import redis_from_url

    redis = redis_from_url(url)
    try:
        if once:
            console.print(render(await read_frame(redis)))
            return
        with Live(render(await read_frame(redis)), console=console, screen=False, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(interval_s)
                live.update(render(await read_frame(redis)), refresh=True)
    finally:
        await redis.aclose()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate top", description=__doc__.split("\n")[0])
    p.add_argument(
        "--redis", default=os.environ.get("KVGATE_REDIS_URL"), help="Redis URL (or KVGATE_REDIS_URL)"
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    args = p.parse_args(argv)
    if not args.redis:
        print("kvgate top: --redis (or KVGATE_REDIS_URL) is required", file=sys.stderr)
        return 2
    try:
        asyncio.run(run(args.redis, max(args.interval, 0.1), args.once, Console()))
    except KeyboardInterrupt:
        return 0
    except (OSError, ConnectionError) as e:
        print(f"kvgate top: {e}", file=sys.stderr)
        return 1
    return 0
