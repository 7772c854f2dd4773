"""Dispatch, the third part on a completion request: point the admitted request at its worker.

The worker was chosen and the slot placed on it by admission (two-step admission, plugin/admit.py);
this part rewrites the upstream, sets `x-request-id`, and asks the worker for the stream's usage
when the client did not (so the gateway can meter it; the usage chunk is stripped again on the way out).
"""

from __future__ import annotations

from mitmproxy import http

from plugin.errors import GatewayError
from plugin.flow import accepted, fail_closed
from plugin.metrics import GatewayMetrics


class Dispatch:
    """Request-path part: rewrite the upstream of an admitted request. Needs only whether to ask for
    usage (`[streaming] collect_usage`) and the metrics, not the whole gateway context."""

    def __init__(self, *, collect_usage: bool, metrics: GatewayMetrics) -> None:
        self.collect_usage, self.metrics = collect_usage, metrics

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
        request.headers["x-request-id"] = state.request_id
        ask_usage = parsed.endpoint.request_usage
        wanted = parsed.stream and not parsed.include_usage and self.collect_usage
        if ask_usage is not None and wanted:
            request.content = ask_usage(request.content or b"", parsed.body)
            state.usage_requested = True
        kind = "hit" if route.view.prefix_hits.get(route.worker.id, 0) else "miss"
        self.metrics.routed.inc(parsed.model, route.worker.id, kind)
