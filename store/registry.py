"""The worker registry in Redis: who serves a model, where, how loaded, and whose lease is still valid.

Written by node agents (register, heartbeat, drain, deregister) and read by gateways (`read_workers`,
mirrored in process). Gateways also `register` static workers given on their command line. Layout
(docs/REDIS.md): `kvg:{m}:workers` ZSET worker id -> lease expiry (ms), `kvg:{m}:worker:<id>` HASH of
the record, `kvg:models` SET of model names. Every multi-key change is one Lua script, so a reader
never sees a lease without its record, and each call costs one round trip.

Times are integer milliseconds of the caller's wall clock, passed in explicitly (`now_ms`) so tests
and the simulator control time. Works with clients created with or without `decode_responses`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from policy.worker_auth import (
    HEARTBEAT_FIELD,
    REGISTRATION_FIELD,
    heartbeat_signature,
    registration_signature,
)
from store import keys
from store.connect import is_cluster
from store.scripting import LuaScript, load

# Scripts (store/lua/registry_*.lua) touch only keys of one model (one hash slot on Redis Cluster);
# the unhashed `kvg:models` discovery set is updated by a separate command in the same pipeline.
_REGISTER = load("registry_register.lua")
_HEARTBEAT = load("registry_heartbeat.lua")
_SET_IF_REGISTERED = load("registry_set_field.lua")
_BUMP_EPOCH = load("registry_bump_epoch.lua")
_DEREGISTER = load("registry_deregister.lua")
_READ = load("registry_read.lua")
_PRUNE = load("registry_prune.lua")


class RegistrationRefused(Exception):
    """The worker id is held by a live registration with another URL."""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One worker's registration and latest load, as stored under one model.

    `live` is computed by `read_workers`: the lease expires in the future. Expired workers are
    returned too (live=False) so a gateway can reclaim the slots they held; route only to live,
    non-draining workers.
    """

    id: str
    model: str
    url: str
    models: tuple[str, ...] = ()  # every model the worker serves (from its /v1/models)
    max_concurrency: int = 0  # 0 = unknown
    capacity_tokens: int = 0  # KV cache size in tokens (num_gpu_blocks * block_size); 0 = unknown
    block_size: int = 0
    num_gpu_blocks: int = 0
    router_block_size: int = 0  # exact mode: tokens per block of the agent's index entries; 0 = no KV events
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    joined_ms: int = 0
    updated_ms: int = 0
    draining: bool = False
    inflight_ids: tuple[str, ...] = ()  # request ids the worker reports in flight (empty if it cannot)
    epoch: int = 0  # changes when the worker restarts or clears its cache: drop its index entries
    lease_expiry_ms: int = 0
    live: bool = True
    extra: dict[str, str] = field(default_factory=dict)  # fields this version does not know


_INT_FIELDS = (
    "max_concurrency", "capacity_tokens", "block_size", "num_gpu_blocks", "router_block_size", "running",
    "waiting",
)  # fmt: skip
_INT_FIELDS_MS = ("joined_ms", "updated_ms", "epoch")
_KNOWN = {  # (the signature fields stay in `extra`: the gateway's mirror checks them)
    "url",
    "models",
    "kv_usage",
    "draining",
    "inflight_ids",
    *_INT_FIELDS,
    *_INT_FIELDS_MS,
}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _flat(mapping: dict[str, str | int | float]) -> list[str | int | float]:
    return [item for pair in mapping.items() for item in pair]


def load_fields(
    *, running: int, waiting: int, kv_usage: float, inflight_ids: Sequence[str], now_ms: int
) -> dict[str, str | int | float]:
    """The hash fields a heartbeat rewrites."""
    return {
        "running": int(running),
        "waiting": int(waiting),
        "kv_usage": float(kv_usage),
        "inflight_ids": json.dumps(list(inflight_ids)),
        "updated_ms": int(now_ms),
    }


def record_fields(record: WorkerRecord, now_ms: int) -> dict[str, str | int | float]:
    """The hash fields a registration writes (the epoch is incremented by the script)."""
    fields: dict[str, str | int | float] = {
        "url": record.url,
        "models": json.dumps(list(record.models or (record.model,))),
        "max_concurrency": record.max_concurrency,
        "capacity_tokens": record.capacity_tokens,
        "block_size": record.block_size,
        "num_gpu_blocks": record.num_gpu_blocks,
        "router_block_size": record.router_block_size,
        "joined_ms": int(now_ms),
        "draining": int(record.draining),
    }
    fields.update(
        load_fields(
            running=record.running,
            waiting=record.waiting,
            kv_usage=record.kv_usage,
            inflight_ids=record.inflight_ids,
            now_ms=now_ms,
        )
    )
    return fields


def parse_record(
    model: str, worker_id: str, lease_expiry_ms: int, raw: dict[str, str], now_ms: int
) -> WorkerRecord:
    """A `WorkerRecord` from the stored hash (strings); tolerant of missing fields."""

    def num(name: str) -> int:
        try:
            return int(float(raw.get(name, "0") or 0))
        except ValueError:
            return 0

    try:
        inflight = tuple(str(x) for x in json.loads(raw.get("inflight_ids", "[]") or "[]"))
    except (ValueError, TypeError):
        inflight = ()
    try:
        models = tuple(str(x) for x in json.loads(raw.get("models", "[]") or "[]"))
    except (ValueError, TypeError):
        models = ()
    try:
        kv_usage = float(raw.get("kv_usage", "0") or 0)
    except ValueError:
        kv_usage = 0.0
    return WorkerRecord(
        id=worker_id,
        model=model,
        url=raw.get("url", ""),
        models=models or (model,),
        max_concurrency=num("max_concurrency"),
        capacity_tokens=num("capacity_tokens"),
        block_size=num("block_size"),
        num_gpu_blocks=num("num_gpu_blocks"),
        router_block_size=num("router_block_size"),
        running=num("running"),
        waiting=num("waiting"),
        kv_usage=kv_usage,
        joined_ms=num("joined_ms"),
        updated_ms=num("updated_ms"),
        draining=raw.get("draining", "0") not in ("0", ""),
        inflight_ids=inflight,
        epoch=num("epoch"),
        lease_expiry_ms=lease_expiry_ms,
        live=lease_expiry_ms > now_ms,
        extra={k: v for k, v in raw.items() if k not in _KNOWN},
    )


async def _eval(redis: aioredis.Redis, script: LuaScript, keys_: Sequence[str], args: Sequence[Any]) -> Any:
    return await script(redis, keys_, args)


def signed_fields(record: WorkerRecord, now_ms: int, secret: bytes) -> dict[str, str | int | float]:
    """`record_fields` plus the registration and heartbeat signatures (policy/worker_auth.py)."""
    fields = record_fields(record, now_ms)
    if secret:
        fields[REGISTRATION_FIELD] = registration_signature(
            secret, record.model, record.id, record.url, record.max_concurrency, int(now_ms)
        )
        fields[HEARTBEAT_FIELD] = heartbeat_signature(
            secret, record.model, record.id, record.url, int(now_ms)
        )
    return fields


async def register(
    redis: aioredis.Redis, record: WorkerRecord, lease_ms: int, now_ms: int, secret: bytes = b""
) -> int:
    """Register (or re-register) `record` under `record.model` with a lease of `lease_ms`, signed
    with `secret` when given.

    Replaces any previous record of the same id, sets `joined_ms` to now and returns the new epoch
    (registration always starts a new epoch: the worker's cache state is not known to be the old one).
    Raises RegistrationRefused when the id is held by a live lease with another URL.
    """
    keys.model_key(record.model)  # validates the name
    keys_ = (keys.workers(record.model), keys.worker(record.model, record.id))
    args = (record.id, now_ms + lease_ms, now_ms, record.url, *_flat(signed_fields(record, now_ms, secret)))

    async def once() -> int:
        async with redis.pipeline(transaction=False) as pipe:
            _REGISTER.queue(pipe, keys_, args)
            pipe.sadd(keys.models(), record.model)
            epoch, _ = await pipe.execute()
        return int(epoch)

    if is_cluster(redis):  # a cluster pipeline may not carry EVALSHA; `kvg:models` is in another slot
        epoch = int(await _REGISTER(redis, keys_, args))
        await redis.sadd(keys.models(), record.model)
    else:
        try:
            epoch = await once()
        except NoScriptError:  # a fresh server or SCRIPT FLUSH: only the SADD ran (idempotent)
            await _REGISTER.ensure_loaded(redis)
            epoch = await once()
    if epoch < 0:
        raise RegistrationRefused(
            f"worker id {record.id!r} of {record.model} is held by a live worker with another URL; "
            f"{record.url} not registered"
        )
    return epoch


async def heartbeat(
    redis: aioredis.Redis,
    model: str,
    worker_id: str,
    *,
    running: int,
    waiting: int,
    kv_usage: float,
    inflight_ids: Sequence[str] = (),
    lease_ms: int,
    now_ms: int,
    url: str = "",
    secret: bytes = b"",
) -> bool | None:
    """Renew the lease and write the latest load in one round trip (signed for `url` with `secret`).

    Returns the worker's `draining` flag, or None if it is not registered (never was, deregistered,
    or pruned after its lease expired): the caller should `register` again.
    """
    fields = load_fields(
        running=running, waiting=waiting, kv_usage=kv_usage, inflight_ids=inflight_ids, now_ms=now_ms
    )
    if secret:
        fields[HEARTBEAT_FIELD] = heartbeat_signature(secret, model, worker_id, url, int(now_ms))
    reply = int(
        await _eval(
            redis,
            _HEARTBEAT,
            (keys.workers(model), keys.worker(model, worker_id)),
            (worker_id, now_ms + lease_ms, *_flat(fields)),
        )
    )
    return None if reply < 0 else bool(reply)


async def set_draining(redis: aioredis.Redis, model: str, worker_id: str, draining: bool) -> bool:
    """Set or clear the worker's drain flag; False if the worker is not registered."""
    reply = await _eval(
        redis, _SET_IF_REGISTERED, (keys.worker(model, worker_id),), ("draining", int(draining))
    )
    return bool(int(reply))


async def bump_epoch(redis: aioredis.Redis, model: str, worker_id: str) -> int:
    """Start a new epoch (worker restarted or cleared its cache); 0 if the worker is not registered."""
    return int(await _eval(redis, _BUMP_EPOCH, (keys.worker(model, worker_id),), ()))


async def deregister(redis: aioredis.Redis, model: str, worker_id: str) -> bool:
    """Remove the worker from the model's pool at once; False if it was not registered."""
    existed, left = await _eval(
        redis, _DEREGISTER, (keys.workers(model), keys.worker(model, worker_id)), (worker_id,)
    )
    if int(left) == 0:
        await redis.srem(keys.models(), model)
    return bool(int(existed))


async def read_workers(redis: aioredis.Redis, model: str, now_ms: int) -> list[WorkerRecord]:
    """Every registered worker of `model`, sorted by id, in one round trip.

    Expired leases are included with `live=False` (their slots are to be reclaimed); they stay until
    `prune_expired` removes them or the agent comes back and renews.
    """
    reply = await _eval(redis, _READ, (keys.workers(model),), (keys.worker(model, ""),))
    records = []
    for i in range(0, len(reply), 3):
        worker_id, expiry, flat = _text(reply[i]), int(float(_text(reply[i + 1]))), reply[i + 2]
        raw = {_text(flat[j]): _text(flat[j + 1]) for j in range(0, len(flat), 2)}
        records.append(parse_record(model, worker_id, expiry, raw, now_ms))
    return sorted(records, key=lambda r: r.id)


async def read_worker(redis: aioredis.Redis, model: str, worker_id: str, now_ms: int) -> WorkerRecord | None:
    """One worker's record, or None if it is not registered."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zscore(keys.workers(model), worker_id)
        pipe.hgetall(keys.worker(model, worker_id))
        expiry, flat = await pipe.execute()
    if expiry is None or not flat:
        return None
    raw = {_text(k): _text(v) for k, v in flat.items()}
    return parse_record(model, worker_id, int(expiry), raw, now_ms)


async def prune_expired(redis: aioredis.Redis, model: str, now_ms: int, grace_ms: int = 0) -> list[str]:
    """Delete workers whose lease expired more than `grace_ms` ago; returns their ids."""
    gone = await _eval(redis, _PRUNE, (keys.workers(model),), (now_ms - grace_ms, keys.worker(model, "")))
    if gone and await redis.zcard(keys.workers(model)) == 0:
        await redis.srem(keys.models(), model)
    return [_text(g) for g in gone]


async def list_models(redis: aioredis.Redis) -> list[str]:
    """Model names that have (or recently had) registered workers, sorted."""
    return sorted(_text(m) for m in await redis.smembers(keys.models()))


def models_of(records: Iterable[WorkerRecord]) -> list[str]:
    """Union of the models served by live, non-draining workers (for a gateway's /v1/models)."""
    return sorted({m for r in records if r.live and not r.draining for m in r.models})
