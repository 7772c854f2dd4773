"""Cut off clients that are too slow to send their request: slowloris bodies and idle connections.

mitmproxy's only client timeout is `tcp_timeout`, an *idle* timeout that any byte resets, and
kvgate sets it to an hour so silent generations survive (plugin/launcher.py). So a client sending its
body one byte every few seconds, or opening connections and sending nothing (or half its headers),
would hold a connection, its buffers and a file descriptor for as long as it likes: nginx bounds the
same with `client_header_timeout` / `client_body_timeout` / `keepalive_timeout`.

`ClientDeadline` bounds the time a client may take to hand over a complete request (headers and body):
`limits.client_request_timeout_ms`, counted from the connection's open or from the end of its previous
answer (an idle keep-alive connection owes its next request too). While a request of the connection
is being admitted, routed or answered, no deadline runs: the wait is the gateway's, not the client's.
This addon must come before KvGate in the addon chain, whose `request` hook awaits admission for as
long as a request queues. A sweep once a second closes connections past their deadline through
mitmproxy's own timeout path (`ConnectionHandler.on_timeout`), so the client sees a plain close, as
from nginx. Nothing else waits on such a client: mitmproxy serves every connection on its own task.

Client pools should close idle connections sooner than this (aiohttp: 15 s, httpx and the openai SDK:
5 s), or a request sent just as the gateway closes the idle connection fails like one sent to any
server's keep-alive timeout. With HTTP/2 the deadline runs only while no stream of the connection is
in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from mitmproxy import connection, ctx, http

from plugin.config import ConfigError, load_config
from runtime.tasks import spawn

log = logging.getLogger("kvgate.client_deadline")

SWEEP_S = 1.0


class ClientDeadline:
    """The mitmproxy addon; see the module doc."""

    def __init__(self) -> None:
        self.timeout_s = 60.0
        self.deadlines: dict[str, float] = {}  # client id -> monotonic deadline (clients that owe a request)
        self.in_flight: dict[str, int] = {}  # client id -> its requests received and not yet answered
        self.cut_off = 0  # connections closed for being too slow (logged, and read by tests)
        self._sweeper: asyncio.Task[None] | None = None

    def configure(self, updated: set[str]) -> None:
        if "kvgate_config" in updated:  # KvGate's option: this addon comes first in the chain (see `request`)
            try:
                limits = load_config(ctx.options.kvgate_config).limits
            except ConfigError:
                return  # KvGate reports an invalid config and stops the gateway
            self.timeout_s = limits.client_request_timeout_ms / 1000

    async def running(self) -> None:
        self._sweeper = spawn(self.sweep(), name="kvgate-client-deadline")

    async def done(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    # -- a connection's requests -------------------------------------------------------------------
    def client_connected(self, client: connection.Client) -> None:
        self.deadlines[client.id] = time.monotonic() + self.timeout_s

    def request(self, flow: http.HTTPFlow) -> None:
        """The whole request is in: it waits on us now. Must run before KvGate's `request`, which
        awaits admission (the chain runs one addon's hook after the other)."""
        cid = flow.client_conn.id
        self.in_flight[cid] = self.in_flight.get(cid, 0) + 1
        self.deadlines.pop(cid, None)

    def response(self, flow: http.HTTPFlow) -> None:
        self._answered(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._answered(flow)

    def _answered(self, flow: http.HTTPFlow) -> None:
        cid = flow.client_conn.id
        left = self.in_flight.pop(cid, 0) - 1
        if left > 0:
            self.in_flight[cid] = left
        elif flow.client_conn.connected:  # keep-alive: the next request is owed within the timeout
            self.deadlines[cid] = time.monotonic() + self.timeout_s

    def client_disconnected(self, client: connection.Client) -> None:
        self.deadlines.pop(client.id, None)
        self.in_flight.pop(client.id, None)

    # -- the sweep ---------------------------------------------------------------------------------
    async def sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.close_overdue(time.monotonic())

    def close_overdue(self, now: float) -> None:
        overdue = [cid for cid, deadline in self.deadlines.items() if deadline <= now]
        if not overdue:
            return
        connections: dict[Any, Any] = getattr(ctx.master.addons.get("proxyserver"), "connections", {})
        for cid in overdue:
            del self.deadlines[cid]
            handler = connections.get(cid)
            if handler is None:
                continue  # closed in the meantime
            self.cut_off += 1
            log.warning(
                "closing a client connection that sent no complete request within %.0f s (%s)",
                self.timeout_s, handler.client.peername,
            )  # fmt: skip
            spawn(handler.on_timeout(), name="kvgate-client-deadline-close")
