"""Explicit session affinity in the gateway: the `x-kvgate-session-id` header, its binding in Redis.

    intake     `session_ref(headers)`: the validated id (1-128 of [A-Za-z0-9._:-], like x-request-id;
               400 `invalid_session_id` otherwise) and `x-kvgate-session-close` (true/1: the session
               ends with this request; 400 `invalid_session_close` for anything but true/false/1/0)
    admission  `lookup()`: the binding (store/sessions.py, one HMGET) before the routing choice; the
               policy weighs it as a soft preference (policy/session.py)
    placed     `routed()`: counts the outcome (kvgate_session_routes_total), (re)binds the session to
               the chosen worker with the request's prompt tokens, and renews it while in flight
    finished   `finished()`: the TTL slides from the session's last request; with the close header the
               binding is deleted at once (Dynamo's session close on the last turn)

Writes go through one background loop, in order (a close is never overtaken by its own bind), so the
request path never waits for them; a failed write is logged (the binding is a preference: the next
request is routed by the cost model alone). While requests of a session are in flight on this gateway,
`RENEW_SHARE` of the TTL after the last renewal the loop extends their bindings in one round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from plugin.errors import GatewayError
from plugin.flow import SessionRef
from policy.session import outcome
from runtime.tasks import Background
from store import sessions

if TYPE_CHECKING:
    from collections.abc import Mapping

    from plugin.flow import Route
    from plugin.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-kvgate-session-id"
CLOSE_HEADER = "x-kvgate-session-close"
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
RENEW_SHARE = 1 / 3  # renew in-flight sessions' bindings every third of the TTL
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def session_ref(headers: Mapping[str, str]) -> SessionRef | None:
    """The request's validated session headers; None without a session id. GatewayError 400."""
    value = headers.get(SESSION_HEADER)
    close = headers.get(CLOSE_HEADER)
    if value is None or value == "":
        if close is not None:
            raise GatewayError(
                400, "invalid_session_close", f"{CLOSE_HEADER} needs an {SESSION_HEADER}", param=CLOSE_HEADER
            )
        return None
    if SESSION_ID.fullmatch(value) is None:
        raise GatewayError(
            400, "invalid_session_id",
            f"{SESSION_HEADER} must be 1-128 characters of letters, digits, '.', '_', ':' or '-'",
            param=SESSION_HEADER,
        )  # fmt: skip
    flag = (close or "false").strip().lower()
    if flag not in _TRUE + _FALSE:
        raise GatewayError(
            400, "invalid_session_close", f"{CLOSE_HEADER} must be true, false, 1 or 0", param=CLOSE_HEADER
        )
    return SessionRef(value, close=flag in _TRUE)


class SessionAffinity:
    """This gateway's side of the session bindings; `start()` the writer, `close()` flushes it."""

    def __init__(self, redis: aioredis.Redis | None, ttl_s: float, metrics: GatewayMetrics) -> None:
        self.redis = redis
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.metrics = metrics
        self.active: dict[tuple[str, str], int] = {}  # (model, session id) -> its requests in flight here
        self._ops: deque[tuple[str, str, str, str, int]] = deque()  # (op, model, id, worker, tokens)
        self._wake = asyncio.Event()
        self._loop = Background("kvgate-sessions")
        self.written = 0  # writes that reached Redis (binds, closes, renewals)

    async def lookup(self, model: str, ref: SessionRef) -> None:
        """Read the session's binding before the routing choice (RedisError: the caller's 503)."""
        if self.redis is not None:
            ref.binding = await sessions.lookup(self.redis, model, ref.id)

    def routed(self, route: Route, ref: SessionRef) -> None:
        """The request was placed on `route`: count what the session did, bind it there."""
        ref.outcome = outcome(route.view, route.decision)
        self.metrics.session_routes.inc(route.model, ref.outcome)
        ref.bound_to = route.worker.id
        key = (route.model, ref.id)
        self.active[key] = self.active.get(key, 0) + 1
        self._queue("bind", route.model, ref.id, route.worker.id, route.view.prompt_tokens)

    def rerouted(self, route: Route, ref: SessionRef) -> None:
        """The placed request moved to another worker (its first refused the connection): bind it there."""
        if ref.bound_to:
            ref.bound_to = route.worker.id
            self._queue("bind", route.model, ref.id, route.worker.id, route.view.prompt_tokens)

    def finished(self, model: str, ref: SessionRef) -> None:
        """A request of the session ended (any way): slide its TTL, or drop it when the client closed it."""
        if ref.bound_to:
            key = (model, ref.id)
            left = self.active.get(key, 0) - 1
            if left > 0:
                self.active[key] = left
            else:
                self.active.pop(key, None)
            ref.bound_to = ""
        if ref.close and ref.outcome:  # placed: a refused last turn is retried or expires
            self.metrics.sessions_closed.inc(model)
            self._queue("close", model, ref.id, "", 0)
        elif ref.outcome:
            self._queue("renew", model, ref.id, "", 0)

    def _queue(self, op: str, model: str, session_id: str, worker: str, tokens: int) -> None:
        self._ops.append((op, model, session_id, worker, tokens))
        self._wake.set()

    # -- the writer ----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.redis is not None:
            self._loop.start(self._run())

    async def close(self) -> None:
        await self._loop.stop()
        await self.flush()

    async def _run(self) -> None:
        renew_every_s = self.ttl_ms / 1000 * RENEW_SHARE
        last_renewal = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=renew_every_s)
            self._wake.clear()
            await self.flush()
            if time.monotonic() - last_renewal >= renew_every_s:
                last_renewal = time.monotonic()
                await self.renew_active()

    async def flush(self) -> None:
        """Send the queued writes, in order."""
        redis = self.redis
        while self._ops and redis is not None:
            op, model, session_id, worker, tokens = self._ops.popleft()
            try:
                if op == "bind":
                    now_ms = int(time.time() * 1000)
                    await sessions.bind(redis, model, session_id, worker, tokens, self.ttl_ms, now_ms)
                elif op == "close":
                    await sessions.close(redis, model, session_id)
                else:
                    await sessions.renew(redis, [(model, session_id)], self.ttl_ms)
                self.written += 1
            except (RedisError, OSError) as e:
                logger.warning("session %s of %s: %s failed: %s", session_id, model, op, e)

    async def renew_active(self) -> None:
        """Extend the bindings of the sessions with requests in flight here (one round trip)."""
        if self.redis is None or not self.active:
            return
        try:
            await sessions.renew(self.redis, list(self.active), self.ttl_ms)
            self.written += 1
        except (RedisError, OSError) as e:
            logger.warning("renewing %d session bindings failed: %s", len(self.active), e)
