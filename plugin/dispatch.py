"""Dispatch, the third part on a completion request: point the admitted request at its worker.

The worker was chosen and the slot placed on it by admission (two-step admission, plugin/admit.py);
this part rewrites the upstream, sets `x-request-id`, and asks the worker for the stream's usage
when the client did not (so the gateway can meter it; the usage chunk is stripped again on the way out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mitmproxy import http
from mitmproxy.net.http import url

from plugin.errors import GatewayError
from plugin.flow import Upstream, accepted, fail_closed, now_s, remember
from plugin.metrics import GatewayMetrics


class Dispatch:
    """Request-path part: rewrite the upstream of an admitted request. Needs only whether to ask for
    usage (`[streaming] collect_usage`) and the metrics, not the whole gateway context."""

    def __init__(
        self,
        *,
        collect_usage: bool,
        metrics: GatewayMetrics,
        upstream_key: Callable[[str], str] = lambda worker_id: "",
    ) -> None:
        self.collect_usage, self.metrics = collect_usage, metrics
        self.upstream_key = upstream_key  # worker id -> the API key it gets ("" = none)
        # a worker's address as the request fields take it (bounded: plugin/flow.py remember)
        self._targets: dict[tuple[str, str, int], Target] = {}

    @fail_closed
    async def request(self, flow: http.HTTPFlow) -> None:
        found = accepted(flow)
        if found is None:
            return
        state, parsed = found.state, found.parsed
        route = state.route  # chosen and placed by admission
        if route is None:
            flow.response = GatewayError(
                503, "no_healthy_worker", f"no healthy worker for {parsed.model!r}", retry_after_s=1
            ).to_response()
            return
        request = flow.request
        up = route.upstream
        where = (up.scheme, up.host, up.port)  # a tuple's hash is C; the dataclass's is a Python call
        target = self._targets.get(where)
        if target is None:
            target = remember(self._targets, where, Target.of(up))
        key = self.upstream_key(route.worker.id)
        point_at(request, target, state.request_id, key)
        ask_usage = parsed.endpoint.request_usage
        wanted = parsed.stream and not parsed.include_usage and self.collect_usage
        if ask_usage is not None and wanted:
            request.content = ask_usage(request.content or b"", parsed.body)
            state.usage_requested = True
        kind = "hit" if route.view.prefix_hits.get(route.worker.id, 0) else "miss"
        self.metrics.routed.inc(parsed.model, route.worker.id, kind, state.arm)
        previous = route.view.sticky_worker  # where this prefix's previous request went (policy/state.py)
        if previous is not None and previous != route.worker.id:
            self.metrics.prefix_switches.inc(parsed.model, state.arm)
        state.dispatched_at = now_s()


# Never forwarded from a client: hop-by-hop headers (RFC 9110 §7.6.1; framing headers stay, mitmproxy
# frames the body), client-claimed forwarding chains, and the client's credentials.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate",
     b"te", b"trailer", b"upgrade"}
)  # fmt: skip
NOT_FORWARDED = HOP_BY_HOP | {
    b"x-forwarded-for", b"forwarded", b"x-real-ip", b"authorization", b"x-request-id"
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Target:
    """An upstream as mitmproxy's request fields hold it: what `request.scheme, request.host,
    request.port = ...` would store, computed once per worker instead of once per request."""

    scheme: bytes  # RequestData.scheme (the `scheme` setter: UTF-8, surrogateescape)
    host: str
    port: int
    host_header: bytes  # the Host header's value the port setter writes: url.hostport(), as bytes
    authority: bytes  # the authority it writes (HTTP/2 requests, or an absolute-form target)

    @classmethod
    def of(cls, up: Upstream) -> Target:
        hostport = url.hostport(up.scheme, up.host, up.port)
        try:  # as mitmproxy's `authority` setter encodes a text value
            authority = hostport.encode("idna", "strict")
        except UnicodeError:
            authority = hostport.encode("utf8", "surrogateescape")
        return cls(
            up.scheme.encode("utf-8", "surrogateescape"), up.host, up.port,
            hostport.encode("utf-8", "surrogateescape"), authority,
        )  # fmt: skip


def point_at(request: http.Request, target: Target, request_id: str, upstream_key: str) -> None:
    """`request.scheme, request.host, request.port = ...` then `sanitize_upstream_headers`, in one
    rebuild of the header fields: the same end state (the port setter's `headers["Host"] = host:port`
    when a Host header is present: the first one takes the value in its place, later ones go; a
    non-empty authority becomes host:port too), without the setters' scans of the header list."""
    data = request.data
    data.scheme, data.host, data.port = target.scheme, target.host, target.port
    if data.authority:
        data.authority = target.authority
    _sanitized(data.headers, request_id, upstream_key, target.host_header)


def sanitize_upstream_headers(headers: http.Headers, request_id: str, upstream_key: str) -> None:
    """What the worker gets: the client's headers minus hop-by-hop ones (and those the client's
    `Connection` names), `x-kvgate-*`, forwarding chains and `Authorization`; then the gateway's
    request id and, if configured, the worker's own API key (vLLM's `--api-key`)."""
    _sanitized(headers, request_id, upstream_key, None)


def _sanitized(headers: http.Headers, request_id: str, upstream_key: str, host: bytes | None) -> None:
    """`sanitize_upstream_headers`, with the Host header's value replaced by `host` first (if given)."""
    fields = headers.fields
    named = {
        token.strip().lower().encode()
        for name, value in fields
        if name.lower() == b"connection"
        for token in value.decode("latin-1").split(",")
    }
    kept = []
    replacing = host is not None
    for name, value in fields:
        low = name.lower()
        if replacing and low == b"host":
            if host is None:
                continue  # a later Host header: gone, as with the setter's replacement
            value, host = host, None
        if low not in NOT_FORWARDED and low not in named and not low.startswith(b"x-kvgate-"):
            kept.append((name, value))
    kept.append((b"x-request-id", request_id.encode()))
    if upstream_key:
        kept.append((b"authorization", b"Bearer " + upstream_key.encode()))
    headers.fields = tuple(kept)
