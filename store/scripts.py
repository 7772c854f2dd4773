"""The admission Lua scripts, loaded once and called through typed async wrappers.

`store/lua/common.lua` holds the rules every script shares (reap expired leases and waiters, quota
checks, the grant pump); each `lua/<verb>.lua` is loaded after it by the one Lua loader
(store/scripting.py). Calls go as EVALSHA over a dedicated pipelined connection (store/resp.py:
redis-py's layers cost several times more CPU per call); a `NOSCRIPT` reply (e.g. after `SCRIPT FLUSH`)
or a connection kind it does not handle falls back to redis-py and the loader, which loads the
script. Lua returns codes; the wrappers return small dataclasses, and `store/slots.py` turns the
rejections into typed errors, as redis-py's lock.py does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Coroutine, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from policy.admission import (
    AdmitCode,
    AdmitResult,
    CheckResult,
    CheckStatus,
    ClaimCode,
    ClaimResult,
    ReleaseCode,
    ReleaseResult,
    RenewResult,
)  # fmt: skip
from policy.types import Band
from store import keys
from store.keys import PREFIX, model_key
from store.resp import Head, RespChannel, head, pack
from store.scripting import LuaScript, load

# one channel for all models; message = JSON list of granted ids, or {"freed": model, "worker": id}
GRANTED_CHANNEL = f"{PREFIX}:admission:granted"
HEADS_MAX = 10_000  # packed command heads kept (AdmissionScripts._head)


def model_keys(model: str, worker: str | None = None) -> list[str]:
    """KEYS of every admission script, in the order common.lua expects; with a worker (two-step
    admission), its registration HASH is KEYS[14]."""
    return list(_model_keys(model, worker))


@functools.lru_cache(maxsize=4096)
def _model_keys(model: str, worker: str | None) -> tuple[str, ...]:
    bands = [b.value for b in Band]
    return (
        model_key(model, "quota"),
        model_key(model, "leases"),
        model_key(model, "lease"),
        model_key(model, "used"),
        *(model_key(model, "queue", str(b)) for b in bands),
        model_key(model, "waiter"),
        model_key(model, "deadline"),
        model_key(model, "qstate"),
        *(model_key(model, "tags", str(b)) for b in bands),
        *([keys.worker(model, worker)] if worker else []),
    )


def quota_key(model: str) -> str:
    """HASH of the model's limits (docs/ADMISSION.md); scripts read it on every call."""
    return model_key(model, "quota")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# acquire.lua's code -> AdmitCode by a dict read (calling the enum is two Python-level calls, per
# acquire); every code is non-zero, so a miss (`or`) falls back to the enum call and its ValueError
_ADMIT_CODES = {code.value: code for code in AdmitCode}
assert all(_ADMIT_CODES)


def _ids(values: Sequence[Any]) -> tuple[str, ...]:
    return tuple(_text(v) for v in values)


def _pairs(flat: Sequence[Any]) -> dict[str, str]:
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}


class AdmissionScripts:
    """The admission scripts registered on one client. `now_ms=None` uses the Redis server's clock,
    so gateways with skewed clocks agree on lease expiry; tests pass explicit times."""

    NAMES = ("acquire", "release", "claim", "renew", "check", "snapshot")

    def __init__(self, redis: aioredis.Redis, channel: str = GRANTED_CHANNEL) -> None:
        self.channel = channel
        self._redis = redis
        self._scripts: dict[str, LuaScript] = {
            name: load(f"{name}.lua", prelude="common.lua") for name in self.NAMES
        }
        self._fast = RespChannel.for_client(redis)
        # EVALSHA sha numkeys keys.. per (script, model, worker); bounded for many models or one-off workers
        # (emptied when full, then refilled by the ones in use: a plain dict, as it is read by every
        # call, where a cachetools LRUCache costs three Python calls per read, bench.hook_cost)
        self._heads: dict[tuple[str, str, str | None], Head] = {}

    async def aclose(self) -> None:
        """Close the dedicated connection (the redis-py client is the caller's to close)."""
        if self._fast is not None:
            await self._fast.aclose()

    async def _call(
        self, name: str, model: str, now_ms: int | None, *args: Any, worker: str | None = None
    ) -> Any:
        if self._fast is not None:
            try:
                return await self._fast.execute(
                    now_ms or 0, self.channel, *args, first=self._head(name, model, worker)
                )
            except NoScriptError:
                pass  # not loaded on this server (yet): redis-py loads it and retries
        argv = [str(now_ms or 0), self.channel, *(str(a) for a in args)]
        return await _answered(self._scripts[name](self._redis, _model_keys(model, worker), argv))

    def _head(self, name: str, model: str, worker: str | None) -> Head:
        first = self._heads.get((name, model, worker))
        if first is None:
            if len(self._heads) >= HEADS_MAX:
                self._heads.clear()
            keys_ = _model_keys(model, worker)
            first = self._heads[(name, model, worker)] = head(
                "EVALSHA", self._scripts[name].sha, len(keys_), *keys_
            )
        return first

    async def acquire(
        self,
        model: str,
        request_id: str,
        band: Band,
        tenant: str,
        seats: int,
        lease_ms: int,
        max_wait_ms: int,
        gateway_id: str,
        now_ms: int | None = None,
        worker: str | None = None,
        reclaim: bool = False,
    ) -> AdmitResult:
        """With `worker`, also checks that worker's max_concurrency (two-step admission). `reclaim`:
        the lease of a running request that Redis lost, taken back (admitted while recovering)."""
        args = (request_id, int(band), tenant, seats, lease_ms, max_wait_ms, gateway_id, worker or "",
                "1" if reclaim else "")  # fmt: skip
        r = await self._call("acquire", model, now_ms, *args, worker=worker)
        return AdmitResult(
            _ADMIT_CODES.get(r[0]) or AdmitCode(int(r[0])), int(r[1]), int(r[2]), _ids(r[6]),
            hold_ms=int(r[3]), capacity=int(r[4]), now_ms=int(r[5]),
        )  # fmt: skip

    async def release(
        self, model: str, request_id: str, now_ms: int | None = None, worker: str | None = None
    ) -> ReleaseResult:
        """With the lease's `worker`, also announces on the channel when that worker stops being full."""
        args = (request_id, model) if worker else (request_id,)
        r = await self._call("release", model, now_ms, *args, worker=worker)
        return ReleaseResult(ReleaseCode(int(r[0])), _ids(r[2]), hold_ms=int(r[1]))

    async def release_many(self, leases: Sequence[tuple[str, str, str | None]]) -> None:
        """`release` for each (model, request id, worker), sent together in one write (one round trip)."""
        if self._fast is not None:
            commands = [
                pack((0, self.channel, rid, model) if worker else (0, self.channel, rid),
                     self._head("release", model, worker))
                for model, rid, worker in leases
            ]  # fmt: skip
            try:
                await self._fast.pipeline_packed(commands)
                return
            except NoScriptError:
                pass  # not loaded yet: one by one through redis-py (releasing twice is harmless)
        for model, rid, worker in leases:
            await self.release(model, rid, worker=worker)

    async def claim(self, model: str, request_id: str, worker: str, now_ms: int | None = None) -> ClaimResult:
        """Place a held lease on a worker (step two for a request that was granted after waiting)."""
        r = await self._call("claim", model, now_ms, request_id, worker, worker=worker)
        return ClaimResult(ClaimCode(int(r[0])), _ids(r[1]))

    async def renew(
        self, model: str, request_ids: Sequence[str], lease_ms: int, now_ms: int | None = None
    ) -> RenewResult:
        r = await self._call("renew", model, now_ms, lease_ms, *request_ids)
        return RenewResult(_ids(r[0]), _ids(r[1]))

    async def check(self, model: str, request_id: str, now_ms: int | None = None) -> CheckResult:
        r = await self._call("check", model, now_ms, request_id)
        return CheckResult(
            CheckStatus(int(r[0])), int(r[1]), _ids(r[4]), hold_ms=int(r[2]), capacity=int(r[3])
        )

    async def snapshot(self, model: str, now_ms: int | None = None) -> dict[str, Any]:
        """Seats in use per dimension, the quota, queue lengths per band, live leases."""
        r = await self._call("snapshot", model, now_ms)
        used = {k: int(v) for k, v in _pairs(r[0]).items()}
        return {
            "used": {
                "total": used.get("total", 0),
                "band": {b.name.lower(): used.get(f"band:{b.value}", 0) for b in Band},
                "tenant": {k.removeprefix("tenant:"): v for k, v in used.items() if k.startswith("tenant:")},
            },
            "quota": _pairs(r[1]),
            "queued": {b.name.lower(): int(r[2][b.value]) for b in Band},
            "leases": int(r[3]),
            "hold_ms": int(r[4]),
            "now_ms": int(r[5]),
            "granted": list(_ids(r[6])),
        }


def register_scripts(redis: aioredis.Redis, channel: str = GRANTED_CHANNEL) -> AdmissionScripts:
    """Register the admission scripts on `redis` (loaded lazily by the first EVALSHA)."""
    return AdmissionScripts(redis, channel)


async def _answered(call: Coroutine[Any, Any, Any]) -> Any:
    """Await a script call through redis-py; if the caller is cancelled, still wait for Redis's reply
    before the cancellation goes on. redis-py drops a connection whose reply was not read, so the
    caller's next command (a queued request leaving, `SlotPool._leave`) goes out on another connection
    and can reach Redis before this one: a cluster then admitted a request after it had left, and the
    seat stayed leased until expiry (tests/lua/test_slot_pool.py, a cancellation at every point). The
    dedicated connection (store/resp.py) answers in order, so it needs none of this."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.shield(task)  # a second cancellation stops the wait, not the call
        raise
