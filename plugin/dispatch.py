"""Dispatch, the third part on a completion request: point the admitted request at its worker.

The worker was chosen and the slot placed on it by admission (two-step admission, plugin/admit.py);
this part rewrites the upstream, sets `x-request-id`, and asks the worker for the stream's usage
when the client did not (so the gateway can meter it; the usage chunk is stripped again on the way out).
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy import http

from plugin.errors import GatewayError
from plugin.flow import accepted, fail_closed
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
        # the host and port setters each rebuild Host/authority: set the host plainly and let the port
        # setter (the last one) rebuild them once, to the same end state
        request.scheme, request.data.host, request.port = up.scheme, up.host, up.port
        key = self.upstream_key(route.worker.id)
        sanitize_upstream_headers(request.headers, state.request_id, key)
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


# Never forwarded from a client: hop-by-hop headers (RFC 9110 §7.6.1; framing headers stay, mitmproxy
# frames the body), client-claimed forwarding chains, and the client's credentials.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"proxy-authenticate",
     b"te", b"trailer", b"upgrade"}
)  # fmt: skip
NOT_FORWARDED = HOP_BY_HOP | {
    b"x-forwarded-for", b"forwarded", b"x-real-ip", b"authorization", b"x-request-id"
}  # fmt: skip


def sanitize_upstream_headers(headers: http.Headers, request_id: str, upstream_key: str) -> None:
    """What the worker gets: the client's headers minus hop-by-hop ones (and those the client's
    `Connection` names), `x-kvgate-*`, forwarding chains and `Authorization`; then the gateway's
    request id and, if configured, the worker's own API key (vLLM's `--api-key`)."""
    named = {
        token.strip().lower().encode()
        for name, value in headers.fields
        if name.lower() == b"connection"
        for token in value.decode("latin-1").split(",")
    }
    kept = tuple(
        (name, value)
        for name, value in headers.fields
        if (low := name.lower()) not in NOT_FORWARDED
        and low not in named
        and not low.startswith(b"x-kvgate-")
    )
    ours = [(b"x-request-id", request_id.encode())]
    if upstream_key:
        ours.append((b"authorization", b"Bearer " + upstream_key.encode()))
    headers.fields = kept + tuple(ours)
