"""The pipelined RESP connection of the admission scripts: reply parsing, FIFO matching, reconnects."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from store.resp import _INCOMPLETE, RespChannel, _parse, pack

PARSE_CASES = [
    pytest.param(b":42\r\n", 42, id="integer"),
    pytest.param(b":-3\r\n", -3, id="negative-integer"),
    pytest.param(b"$5\r\nhello\r\n", b"hello", id="bulk"),
    pytest.param(b"$0\r\n\r\n", b"", id="empty-bulk"),
    pytest.param(b"$-1\r\n", None, id="nil-bulk"),
    pytest.param(b"$4\r\na\r\nb\r\n", b"a\r\nb", id="bulk-with-crlf-inside"),
    pytest.param(b"+OK\r\n", b"OK", id="simple-string"),
    pytest.param(b"*0\r\n", [], id="empty-array"),
    pytest.param(b"*-1\r\n", None, id="nil-array"),
    pytest.param(b"*3\r\n:1\r\n$2\r\nab\r\n*1\r\n:7\r\n", [1, b"ab", [7]], id="nested-array"),
    pytest.param(
        b"*7\r\n:0\r\n:-1\r\n:0\r\n:0\r\n:100000\r\n:1764755000123\r\n*1\r\n$2\r\nr1\r\n",
        [0, -1, 0, 0, 100000, 1764755000123, [b"r1"]],
        id="acquire-reply",
    ),
]


@pytest.mark.parametrize(("raw", "expected"), PARSE_CASES)
def test_parses_each_reply_kind_and_waits_for_the_whole_reply(raw: bytes, expected: object) -> None:
    assert _parse(bytearray(raw), 0) == (expected, len(raw))
    for cut in range(len(raw)):  # every proper prefix is incomplete
        assert _parse(bytearray(raw[:cut]), 0) is _INCOMPLETE


@pytest.mark.parametrize(
    ("raw", "kind"),
    [pytest.param(b"-ERR boom\r\n", ResponseError, id="error"),
     pytest.param(b"-NOSCRIPT No matching script\r\n", NoScriptError, id="noscript")],
)  # fmt: skip
def test_error_replies_become_redis_py_exceptions(raw: bytes, kind: type[Exception]) -> None:
    value, end = _parse(bytearray(raw), 0)
    assert type(value) is kind and end == len(raw)


def test_pack_is_a_resp_array_of_bulk_strings() -> None:
    assert pack(("EVALSHA", b"ab", 1, "k")) == b"*4\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n1\r\n$1\r\nk\r\n"


async def test_concurrent_commands_get_their_own_replies(redis: aioredis.Redis) -> None:
    channel = RespChannel.for_client(redis)
    assert channel is not None
    try:
        await asyncio.gather(*(channel.execute("SET", f"resp:{i}", f"v{i}" * i) for i in range(50)))
        replies = await asyncio.gather(*(channel.execute("GET", f"resp:{i}") for i in range(50)))
        assert replies == [f"v{i}".encode() * i for i in range(50)]
        assert await channel.execute("HGETALL", "resp:none") == []
        with pytest.raises(ResponseError):
            await channel.execute("INCR", "resp:3")  # not an integer
        assert await channel.execute("ECHO", "still in step") == b"still in step"
    finally:
        await channel.aclose()


async def test_a_cancelled_caller_does_not_shift_later_replies(redis: aioredis.Redis) -> None:
    channel = RespChannel.for_client(redis)
    assert channel is not None
    try:
        await channel.execute("PING")
        slow = asyncio.ensure_future(channel.execute("BLPOP", "resp:empty", "0.2"))
        await asyncio.sleep(0.05)
        slow.cancel()
        assert await channel.execute("ECHO", "mine") == b"mine"
    finally:
        await channel.aclose()


async def test_a_pipeline_gives_its_replies_in_order_or_its_first_error(redis: aioredis.Redis) -> None:
    """`pipeline` waits for its last reply only (replies are settled oldest first): the replies in
    order, or the first error reply after all have answered; the connection stays in step, also after
    a pipeline whose caller was cancelled."""
    channel = RespChannel.for_client(redis)
    assert channel is not None
    try:
        assert await channel.pipeline([("SET", f"pipe:{i}", i) for i in range(30)]) == [b"OK"] * 30
        assert await channel.pipeline([("GET", f"pipe:{i}") for i in range(30)]) == [
            b"%d" % i for i in range(30)
        ]
        await channel.execute("SET", "pipe:text", "x")
        with pytest.raises(ResponseError, match="not an integer"):
            await channel.pipeline([("INCR", "pipe:1"), ("INCR", "pipe:text"), ("LPUSH", "pipe:text", "y")])
        assert await channel.execute("GET", "pipe:1") == b"2"  # the commands around the error ran
        assert await channel.pipeline([]) == []
        slow = asyncio.ensure_future(channel.pipeline([("BLPOP", "pipe:empty", "0.2"), ("PING",)]))
        await asyncio.sleep(0.05)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert await channel.pipeline([("ECHO", "mine"), ("ECHO", "too")]) == [b"mine", b"too"]
    finally:
        await channel.aclose()


async def test_reconnects_after_the_server_drops_the_connection(redis: aioredis.Redis) -> None:
    channel = RespChannel.for_client(redis)
    assert channel is not None
    try:
        await channel.execute("CLIENT", "SETNAME", "kvgate-resp-test")
        await redis.execute_command("CLIENT", "KILL", "SKIPME", "yes", "TYPE", "normal")
        assert await channel.execute("ECHO", "again") == b"again"
    finally:
        await channel.aclose()


def test_other_connection_kinds_keep_redis_py() -> None:
    assert RespChannel.for_client(aioredis.Redis.from_url("unix:///tmp/none.sock")) is None
    assert RespChannel.for_client(aioredis.Redis.from_url("rediss://127.0.0.1:1")) is None
    assert RespChannel.for_client(aioredis.Redis.from_url("redis://127.0.0.1:1", protocol=3)) is None
    channel = RespChannel.for_client(aioredis.Redis.from_url("redis://u:pw@127.0.0.1:7/3"))
    assert channel is not None
    assert (channel.host, channel.port, channel.username, channel.password, channel.db) == (
        "127.0.0.1", 7, "u", "pw", 3,
    )  # fmt: skip


async def test_a_server_that_does_not_answer_times_out_and_the_connection_is_dropped() -> None:
    connections: list[asyncio.StreamReader] = []
    writers: list[asyncio.StreamWriter] = []  # kept: a collected writer closes its connection

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(reader)
        writers.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    channel = RespChannel("127.0.0.1", port, timeout_s=0.05)
    try:
        with pytest.raises(RedisTimeoutError):
            await channel.execute("PING")
        assert await asyncio.wait_for(connections[0].read(), 5) == b"*1\r\n$4\r\nPING\r\n"  # then EOF
        with pytest.raises(RedisTimeoutError):
            await channel.pipeline([("PING",), ("PING",)])
        assert len(connections) == 2  # a fresh connection after the dropped one
    finally:
        await channel.aclose()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_each_reply_has_its_own_deadline_under_the_one_timer() -> None:
    """A reply that comes late for the timeout but after an earlier reply was on time is still waited
    for until its own deadline; one that misses its deadline fails its caller, not the next one's."""
    delays = [0.3, 0.3, 5.0]  # the server answers each PING this long after reading it

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for delay in delays:
            await reader.readexactly(len(b"*1\r\n$4\r\nPING\r\n"))
            asyncio.get_running_loop().call_later(delay, writer.write, b"+PONG\r\n")
        await reader.read()

    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    channel = RespChannel("127.0.0.1", server.sockets[0].getsockname()[1], timeout_s=0.5)
    try:
        first = asyncio.ensure_future(channel.execute("PING"))  # due at 0.5, answered at 0.3
        await asyncio.sleep(0.4)
        second = asyncio.ensure_future(channel.execute("PING"))  # due at 0.9, answered at 0.7
        assert await first == b"PONG"
        assert await second == b"PONG"  # past the first's deadline, within its own
        started = asyncio.get_running_loop().time()
        with pytest.raises(RedisTimeoutError):
            await channel.execute("PING")  # answered after 5 s: late
        assert asyncio.get_running_loop().time() - started < 3.0
    finally:
        await channel.aclose()
        server.close()


async def test_a_caller_cancelled_while_connecting_does_not_fail_the_callers_waiting_on_it(
    redis: aioredis.Redis,
) -> None:
    channel = RespChannel.for_client(redis)
    assert channel is not None
    try:
        first = asyncio.ensure_future(channel.execute("PING"))
        second = asyncio.ensure_future(channel.execute("ECHO", "x"))
        await asyncio.sleep(0)  # first is connecting, second waits for that connection
        first.cancel()
        assert await asyncio.wait_for(second, 5) == b"x"
        assert first.cancelled()
    finally:
        await channel.aclose()


async def test_a_command_on_an_idle_connection_is_written_at_once_and_later_ones_together(
    redis: aioredis.Redis,
) -> None:
    """The lone request's round trip starts before the loop runs again (no tick of delay); commands
    issued while a reply is outstanding go out together at the end of the tick."""
    channel = RespChannel.for_client(redis)
    assert channel is not None
    try:
        await channel.execute("PING")  # connected
        protocol = channel._protocol
        assert protocol is not None
        first = RespChannel._send(protocol, pack(("ECHO", "a")))
        assert protocol.outbox == []  # already written
        second = RespChannel._send(protocol, pack(("ECHO", "b")))
        third = RespChannel._send_many(protocol, [pack(("ECHO", "c")), pack(("ECHO", "d"))])
        assert len(protocol.outbox) == 2  # queued behind the outstanding reply, for one write
        assert [await first, await second, *(await asyncio.gather(*third))] == [b"a", b"b", b"c", b"d"]
        assert protocol.outbox == []
        batch = RespChannel._send_many(protocol, [pack(("ECHO", "e")), pack(("ECHO", "f"))])
        assert protocol.outbox == []  # idle again: the whole batch written at once, in order
        assert await asyncio.gather(*batch) == [b"e", b"f"]
    finally:
        await channel.aclose()
