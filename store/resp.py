"""A lean pipelined Redis connection for the admission scripts (the gateway's per-request round trips).

redis-py's asyncio client spends about 150 us of CPU per command in its pool, retry, encoder and
parser layers (measured in-process: PING 149 us; acquire + release 500-740 us), which on a proxy
that saturates one core at a few hundred requests/s is a large share of the budget. `RespChannel`
keeps one dedicated connection, writes each command at once and hands replies to the callers in
FIFO order (Redis answers a connection's commands in order), so concurrent requests share the
connection without waiting for each other. A command on an idle connection (no reply outstanding) is
written at once; while replies are outstanding, the commands issued in the same event-loop tick go out
in one write (one syscall, one read on the server). It speaks only what the scripts need: commands out,
RESP2 replies in (integers, bulk and simple strings, errors, nested arrays). `for_client()` returns
None for anything it does not handle (TLS, Unix sockets, RESP3, Sentinel, Cluster): callers then keep
using redis-py. Replies are bytes, as from a redis-py client without decode_responses.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

CONNECT_TIMEOUT_S = 5.0
DEFAULT_SOCKET_TIMEOUT = 5.0  # redis-py's default reply timeout
_INCOMPLETE = object()


class _Protocol(asyncio.Protocol):
    """Reply parser and FIFO of callers waiting for replies, with one reply deadline for them all.

    Each command's reply is due `timeout_s` after it was sent (redis-py's socket_timeout). As replies
    come in order, only the oldest outstanding one can be the first late: one timer, armed for its due
    time and re-armed for the next when it fires, watches them all, where an `asyncio.wait_for` per
    command cost a timeout context and a timer handle each (bench.hook_cost). A late reply fails its
    caller (and any other already late) with redis-py's TimeoutError and drops the connection, so the
    callers behind it get a connection error (and `execute` resends theirs once)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.due: deque[float] = deque()  # loop time each pending reply is due by, in step with pending
        self.timeout_s = timeout_s
        self._watch: asyncio.TimerHandle | None = None
        self.buffer = bytearray()
        self.lost = False
        self.outbox: list[bytes] = []  # commands of this loop tick, written together by flush()

    def expect(self, futures: list[asyncio.Future[Any]], loop: asyncio.AbstractEventLoop) -> None:
        """`futures` wait for the next replies (one each, in order), due `timeout_s` from now."""
        self.pending.extend(futures)
        if self.timeout_s is not None:
            due = loop.time() + self.timeout_s
            self.due.extend([due] * len(futures))
            if self._watch is None:
                self._watch = loop.call_at(due, self._check)

    def _check(self) -> None:
        self._watch = None
        if not self.due:
            return
        loop = asyncio.get_running_loop()
        if self.due[0] > loop.time():  # the late one answered: watch the oldest outstanding now
            self._watch = loop.call_at(self.due[0], self._check)
            return
        now = loop.time()
        late = RedisTimeoutError(f"Redis did not answer within {self.timeout_s} s")
        while self.due and self.due[0] <= now:
            self.due.popleft()
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(late)
        self.fail(RedisTimeoutError("Redis did not answer in time"))

    def queue(self, command: bytes, count: int = 1) -> None:
        """Send `command` (`count` commands packed together, their futures already pending): at once
        when the connection is idle (no other reply outstanding, nothing queued), so a lone request's
        round trip starts now rather than one loop iteration later; otherwise with the other commands
        of this loop tick, in one write (`flush`)."""
        if not self.outbox:
            if len(self.pending) == count and self.transport is not None and not self.lost:
                self.transport.write(command)
                return
            asyncio.get_running_loop().call_soon(self.flush)
        self.outbox.append(command)

    def flush(self) -> None:
        out, self.outbox = self.outbox, []
        if out and self.transport is not None and not self.lost:
            self.transport.write(b"".join(out))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        pos = 0
        while pos < len(buffer):
            parsed = _parse(buffer, pos)
            if parsed is _INCOMPLETE:
                break
            value, pos = parsed
            if not self.pending:  # a reply nobody asked for: the stream is out of step
                self.fail(RedisConnectionError("unexpected reply from Redis"))
                return
            future = self.pending.popleft()
            if self.due:
                self.due.popleft()
            if future.done():  # its caller was cancelled
                continue
            if isinstance(value, ResponseError):
                future.set_exception(value)
            else:
                future.set_result(value)
        del buffer[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.due.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        error = RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}")
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(error)

    def fail(self, error: Exception) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.connection_lost(error)


def _parse(buf: bytearray, pos: int) -> Any:
    """(value, next position) of the RESP2 reply at `pos`, or _INCOMPLETE."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return _INCOMPLETE
    kind, line, after = buf[pos], buf[pos + 1 : end], end + 2
    if kind == 0x3A:  # ':' integer
        return int(line), after
    if kind == 0x24:  # '$' bulk string
        size = int(line)
        if size < 0:
            return None, after
        if len(buf) < after + size + 2:
            return _INCOMPLETE
        return bytes(buf[after : after + size]), after + size + 2
    if kind == 0x2A:  # '*' array
        count = int(line)
        if count < 0:
            return None, after
        items = []
        for _ in range(count):
            if buf.startswith(b":", after):  # an integer item inline (the admission replies' most)
                end = buf.find(b"\r\n", after)
                if end < 0:
                    return _INCOMPLETE
                items.append(int(buf[after + 1 : end]))
                after = end + 2
                continue
            parsed = _parse(buf, after)
            if parsed is _INCOMPLETE:
                return _INCOMPLETE
            item, after = parsed
            items.append(item)
        return items, after
    if kind == 0x2B:  # '+' simple string
        return bytes(line), after
    if kind == 0x2D:  # '-' error
        message = line.decode(errors="replace")
        return (NoScriptError if message.startswith("NOSCRIPT") else ResponseError)(message), after
    raise RedisConnectionError(f"unexpected RESP type byte {kind!r}")


@dataclass(frozen=True, slots=True)
class Head:
    """The constant first arguments of a command, packed once (e.g. EVALSHA sha numkeys keys...)."""

    count: int
    packed: bytes


def head(*args: Any) -> Head:
    return Head(len(args), _bulk(args))


def pack(args: tuple[Any, ...], first: Head | None = None) -> bytes:
    """One command in RESP: an array of bulk strings (`first`'s arguments, then `args`)."""
    if first is None:
        return b"*%d\r\n%s" % (len(args), _bulk(args))
    return b"*%d\r\n%s%s" % (first.count + len(args), first.packed, _bulk(args))


def _bulk(args: tuple[Any, ...]) -> bytes:
    """Each argument as a RESP bulk string: bytes as they are, anything else as its `str()` in UTF-8.

    One text argument (a decision record's JSON) is encoded and framed at once. Otherwise, with no
    bytes argument, built as one text and encoded once when that text is ASCII (the admission scripts'
    arguments: ids, names, integers), so a character count is a byte count; else argument by argument
    (`_bulk_bytes`). The same bytes every way (tests/property/test_resp_pack.py)."""
    if len(args) == 1 and type(args[0]) is str:
        raw = args[0].encode()
        return b"$%d\r\n%s\r\n" % (len(raw), raw)
    if bytes in map(type, args):  # (checked before the text is built: it would be thrown away)
        return _bulk_bytes(args)
    text = "".join([f"${len(a)}\r\n{a}\r\n" for a in map(str, args)])
    return text.encode() if text.isascii() else _bulk_bytes(args)


def _bulk_bytes(args: tuple[Any, ...]) -> bytes:
    encoded = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    return b"".join([b"$%d\r\n%s\r\n" % (len(raw), raw) for raw in encoded])


class RespChannel:
    """One dedicated, lazily (re)connected connection; `execute()` is safe to call concurrently."""

    def __init__(
        self, host: str, port: int, *, username: str | None = None, password: str | None = None, db: int = 0,
        timeout_s: float | None = DEFAULT_SOCKET_TIMEOUT,
    ) -> None:  # fmt: skip
        self.host, self.port = host, port
        self.username, self.password, self.db = username, password, db
        self.timeout_s = timeout_s  # per reply, as redis-py's socket_timeout; then the connection is dropped
        self._protocol: _Protocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    @classmethod
    def for_client(cls, redis: aioredis.Redis) -> RespChannel | None:
        """A channel to the same server as `redis`, or None if its connection kind is not plain TCP RESP2."""
        pool = getattr(redis, "connection_pool", None)
        if pool is None or pool.connection_class is not Connection:
            return None
        kw = pool.connection_kwargs
        if kw.get("protocol") not in (None, 2, "2"):
            return None
        timeout = kw.get("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
        return cls(
            str(kw.get("host") or "localhost"), int(kw.get("port") or 6379), username=kw.get("username"),
            password=kw.get("password"), db=int(kw.get("db") or 0),
            timeout_s=DEFAULT_SOCKET_TIMEOUT if timeout is None else float(timeout),
        )  # fmt: skip

    async def execute(self, *args: Any, first: Head | None = None) -> Any:
        """Send one command (`first`'s arguments, then `args`) and return its reply; one reconnect and
        resend if the connection is lost before the reply (the admission scripts are idempotent per
        request id)."""
        command = pack(args, first)
        try:
            return await self._round_trip(command)
        except (RedisConnectionError, OSError):
            self._protocol = None
            return await self._round_trip(command)

    async def _round_trip(self, command: bytes) -> Any:
        protocol = await self._ready()
        return await self._send(protocol, command)  # the protocol fails it if late (`_Protocol._check`)

    async def pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send `commands` together (one write) and return their replies; raises the first error
        reply after all have answered. Not resent after a lost connection."""
        return await self.pipeline_packed([pack(c) for c in commands])

    async def pipeline_packed(self, commands: Sequence[bytes]) -> list[Any]:
        """`pipeline` of commands packed already (`pack`).

        Waits for the last reply only: the protocol settles its futures oldest first (`data_received`,
        a late reply in `_Protocol._check`, `connection_lost`), so with the last one settled every one
        is. Then the replies, or the first error among them, as `asyncio.gather` gives them, without
        gather's done callback (a loop callback and two Python calls) per command (bench.hook_cost)."""
        protocol = await self._ready()
        futures = self._send_many(protocol, commands)
        if not futures:
            return []
        try:
            await futures[-1]
        except asyncio.CancelledError:
            for future in futures:  # as gather's cancellation: none of them is waited for any more
                future.cancel()
            raise
        except Exception:
            pass  # the first error in order is raised below (it was settled first)
        error: BaseException | None = None
        for future in futures:
            if not future.done():  # (cannot happen: settled oldest first) the general way
                return list(await asyncio.gather(*futures))
            found = future.exception()  # (read: no "never retrieved" warning for the others)
            if found is not None and error is None:
                error = found
        if error is not None:
            raise error
        return [future.result() for future in futures]

    async def aclose(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()

    @staticmethod
    def _send(protocol: _Protocol, command: bytes) -> asyncio.Future[Any]:
        if protocol.lost or protocol.transport is None:
            raise RedisConnectionError("connection to Redis lost")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        protocol.expect([future], loop)
        protocol.queue(command)
        return future

    @staticmethod
    def _send_many(protocol: _Protocol, commands: Sequence[bytes]) -> list[asyncio.Future[Any]]:
        """`_send` of each command, written together (one write)."""
        if protocol.lost or protocol.transport is None:
            raise RedisConnectionError("connection to Redis lost")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in commands]
        protocol.expect(futures, loop)
        if futures:
            protocol.queue(b"".join(commands), len(futures))
        return futures

    async def _ready(self) -> _Protocol:
        """The live connection; the first caller connects, concurrent callers wait for it (and take
        over if that caller is cancelled meanwhile)."""
        loop = asyncio.get_running_loop()
        while True:
            protocol = self._protocol
            if protocol is not None and not protocol.lost and self._loop is loop:
                return protocol
            waiting_for = self._connecting
            if waiting_for is not None and not waiting_for.done() and self._loop is loop:
                try:
                    return await asyncio.shield(waiting_for)
                except asyncio.CancelledError:
                    me = asyncio.current_task()
                    if waiting_for.cancelled() and me is not None and not me.cancelling():
                        continue  # the connecting caller left, not us: connect ourselves
                    raise
            self._loop = loop
            self._connecting = connecting = loop.create_future()
            try:
                protocol = await self._connect(loop)
            except BaseException as e:
                self._connecting = None
                if isinstance(e, asyncio.CancelledError):
                    connecting.cancel()
                else:
                    connecting.set_exception(e)
                    with contextlib.suppress(BaseException):
                        connecting.exception()  # retrieved: no "never retrieved" warning
                raise
            self._protocol = protocol
            connecting.set_result(protocol)
            return protocol

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Protocol:
        _, protocol = await asyncio.wait_for(
            loop.create_connection(lambda: _Protocol(self.timeout_s), self.host, self.port), CONNECT_TIMEOUT_S
        )
        setup: list[tuple[Any, ...]] = []
        if self.password is not None:
            setup.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            setup.append(("SELECT", self.db))
        for command in setup:
            await asyncio.wait_for(self._send(protocol, pack(command)), CONNECT_TIMEOUT_S)
        return protocol
