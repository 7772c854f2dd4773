"""`kvgate drain`: stop routing new requests to a worker and (optionally) wait for it to empty.

    kvgate drain WORKER_ID [--model M] [--redis URL] [--wait] [--timeout-s N] [--cancel]

Sets the worker's `draining` flag in the registry (store/registry.py); every gateway stops routing to
it within its mirror refresh. The worker's agent keeps renewing its lease while requests finish, then
deregisters it and exits. With `--wait` this command prints the in-flight count (running + waiting as
the worker reports it, and the in-flight ids when the worker reports them) whenever it changes, and
exits 0 once the worker is deregistered (its agent does that after the worker reported nothing in
flight for a few periods) or its lease has expired (it left the pool); exit 1 on timeout, 2 on bad
arguments or an unknown worker. A worker without an agent (static, registered by a gateway) never
deregisters itself: wait on the printed counts or use a timeout.
Without `--model`, the worker is drained in every model it is registered under. `--cancel` clears the
flag (the worker takes traffic again).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import redis.asyncio as aioredis

from runtime import compat
from store import registry
from store.registry import WorkerRecord


def wall_ms() -> int:
    return int(time.time() * 1000)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvgate drain", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument(
        "worker_id", metavar="WORKER_ID", help="worker id as registered (agent default: host:port)"
    )
    p.add_argument("--model", help="model pool (default: every model the worker is registered under)")
    p.add_argument(
        "--redis", default=os.environ.get("KVGATE_REDIS_URL"), help="Redis URL (or KVGATE_REDIS_URL)"
    )
    p.add_argument("--wait", action="store_true", help="wait until the worker has no requests in flight")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up waiting after this long (exit 1)")
    p.add_argument("--poll-ms", type=int, default=250, help="how often to read the registry while waiting")
    p.add_argument("--cancel", action="store_true", help="clear the drain flag instead of setting it")
    return p


def in_flight(record: WorkerRecord) -> int:
    """Requests the worker still holds, by its own report."""
    return max(record.running + record.waiting, len(record.inflight_ids))


async def _models_of(redis: aioredis.Redis, worker_id: str, model: str | None) -> list[str]:
    candidates = [model] if model else await registry.list_models(redis)
    now = wall_ms()
    return [m for m in candidates if await registry.read_worker(redis, m, worker_id, now) is not None]


async def wait_until_empty(
    redis: aioredis.Redis, models: list[str], worker_id: str, timeout_s: float, poll_s: float
) -> int:
    """Poll until every model's record of the worker is gone or expired; returns the exit code."""
    deadline = time.monotonic() + timeout_s
    pending = set(models)
    last_report: dict[str, str] = {}
    while True:
        now = wall_ms()
        for model in sorted(pending):
            record = await registry.read_worker(redis, model, worker_id, now)
            if record is None:
                print(f"{worker_id} [{model}]: deregistered: drained", flush=True)
                pending.discard(model)
                continue
            if not record.live:
                print(f"{worker_id} [{model}]: lease expired: the worker left the pool", flush=True)
                pending.discard(model)
                continue
            report = (
                f"in flight {in_flight(record)} (running={record.running} waiting={record.waiting} "
                f"inflight_ids={len(record.inflight_ids)})"
            )
            if last_report.get(model) != report:
                print(f"{worker_id} [{model}]: {report}", flush=True)
                last_report[model] = report
        if not pending:
            return 0
        if time.monotonic() >= deadline:
            print(f"{worker_id}: still busy after {timeout_s:g} s", file=sys.stderr, flush=True)
            return 1
        await asyncio.sleep(poll_s)


async def drain(args: argparse.Namespace) -> int:
    redis = aioredis.Redis.from_url(args.redis)
    try:
        models = await _models_of(redis, args.worker_id, args.model)
        if not models:
            where = f"model {args.model!r}" if args.model else "any model"
            print(f"kvgate drain: worker {args.worker_id!r} is not registered for {where}", file=sys.stderr)
            return 2
        for model in models:
            await registry.set_draining(redis, model, args.worker_id, not args.cancel)
        verb = "no longer draining" if args.cancel else "draining"
        print(f"{args.worker_id}: {verb} ({', '.join(models)})", flush=True)
        if not args.wait or args.cancel:
            return 0
        return await wait_until_empty(
            redis, models, args.worker_id, args.timeout_s, max(args.poll_ms, 10) / 1000
        )
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    compat.install()
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.redis:
        print("kvgate drain: --redis (or KVGATE_REDIS_URL) is required", file=sys.stderr)
        return 2
    return asyncio.run(drain(args))


if __name__ == "__main__":
    sys.exit(main())
