"""Request intake, the first part on every request: answer local endpoints, refuse bad requests.

In order: the path (404 JSON for anything kvgate does not serve, /metrics and /healthz included:
they are on the metrics port), the gateway's own endpoints (/v1/models, /readyz), drain (503), the
caller (tenant from the API key → 401; band and wait budget from headers → 400), the body (limits
and types → 400/413), the model's worker pool (404 unknown model, 503 none healthy) and the
prompt's prefix hashes (400 for shapes that are not OpenAI requests). A refused request never
reaches admission, routing or the fallback upstream.
"""

from __future__ import annotations

import logging
import os
import re
from time import perf_counter_ns

from mitmproxy import http

from plugin.context import GatewayContext
from plugin.endpoints import route_for
from plugin.errors import GatewayError
from plugin.flow import STATE, FlowState, answered, fail_closed, now_s
from plugin.parse import parse_completion
from plugin.sessions import session_ref


class HeaderMap(dict[str, str]):
    """A request's headers read once: lower-cased name -> value, repeated headers joined with ", " (as
    mitmproxy's `Headers.get` folds them); look names up in lower case (`Auth` lowers the configured
    ones). The few lookups intake makes then cost a dict lookup each (no Python call) instead of a scan
    of mitmproxy's header list."""

    @classmethod
    def of(cls, headers: http.Headers) -> HeaderMap:
        out = cls()
        for name, value in headers.fields:
            key = name.lower().decode("utf-8", "surrogateescape")
            text = value.decode("utf-8", "surrogateescape")
            out[key] = f"{out[key]}, {text}" if key in out else text
        return out


logger = logging.getLogger(__name__)

CORRELATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def correlation_id(value: str | None) -> str:
    """The client's `x-request-id`, validated: 1-128 characters of [A-Za-z0-9._:-] ("" when absent).
    It is only a correlation field (decision records, logs, the lease id's prefix); 400 otherwise,
    so a header with CR, NUL, non-ASCII or 100 KB of text is neither forwarded nor echoed."""
    if value is None or value == "":
        return ""
    if CORRELATION_ID.fullmatch(value) is None:
        raise GatewayError(
            400, "invalid_request_id",
            "x-request-id must be 1-128 characters of letters, digits, '.', '_', ':' or '-'",
        )  # fmt: skip
    return value


def lease_id(correlation: str) -> str:
    """A lease id of the gateway's own: 64 random bits, after the client's correlation id if any, so
    a client reusing an `x-request-id` never shares or takes over another request's lease."""
    token = os.urandom(8).hex()  # secrets.token_hex(8) without its two Python calls (the same source)
    return f"{correlation}.{token}" if correlation else token


class Intake:
    """Request-path part: parse, authenticate and validate; serve the local endpoints."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    @fail_closed
    async def request(self, flow: http.HTTPFlow) -> None:
        if answered(flow):
            return
        ctx = self.ctx
        request = flow.request
        try:
            endpoint = route_for(request.method, request.path)
        except GatewayError as e:
            ctx.metrics.local.inc("unknown")
            flow.response = e.to_response()
            return
        if isinstance(endpoint, str):  # the gateway's own: /v1/models, /readyz
            ctx.metrics.local.inc(endpoint)
            flow.response = await ctx.local.serve(endpoint)
            return
        started = perf_counter_ns()  # the parse stage (plugin/metrics.py HotPathCpu)
        headers = HeaderMap.of(request.headers)
        state = FlowState(request_id=lease_id(""), received_at=now_s())
        flow.metadata[STATE] = state
        try:
            state.client_request_id = correlation_id(headers.get("x-request-id"))
            if state.client_request_id:
                state.request_id = lease_id(state.client_request_id)
            state.session = session_ref(headers)
            if ctx.process.draining:
                raise GatewayError(
                    503, "draining", "the gateway is shutting down; retry elsewhere", retry_after_s=1
                )
            state.caller = ctx.auth.caller(headers)
            if state.caller.clamped:  # counted and logged: a tenant asking above its band
                ctx.metrics.priority_clamped.inc(state.caller.tenant)
                logger.info(
                    "request %s: tenant %s asked above its max_band; clamped to %s",
                    state.request_id, state.caller.tenant, state.caller.band.name.lower(),
                )  # fmt: skip
            # `request.content` (decoded by its Content-Encoding), read without its header lookup when
            # there is none
            body = request.content if "content-encoding" in headers else request.data.content
            parsed = parse_completion(endpoint, body or b"", ctx.config.limits)
            state.parsed = parsed
            if not ctx.workers.known(parsed.model):
                raise GatewayError(
                    404, "model_not_found", f"no worker serves model {parsed.model!r}", param="model"
                )
            if not ctx.workers.routable(parsed.model):
                raise GatewayError(
                    503, "no_healthy_worker", f"no healthy worker for {parsed.model!r}", retry_after_s=1
                )
            hashing = perf_counter_ns()
            state.stage_ns["parse"] = hashing - started
            exact = ctx.router.is_exact(parsed.model)
            chunk_chars = ctx.config.routing.chunk_chars
            try:
                text = endpoint.prefix_text(parsed.body)  # (a bad shape is a 400 in both modes)
                if not exact:
                    prompt = ctx.hasher.hash_text(text, parsed.model, chunk_chars)
            except ValueError as e:
                raise GatewayError(400, "invalid_request", str(e)) from None
            state.stage_ns["hash"] = perf_counter_ns() - hashing  # exact mode's /tokenize: its own metric
            if exact:  # token ids (local tokenizer or a worker); the text-chunk hashes only if none
                tokenizing = perf_counter_ns()
                prompt = await ctx.router.exact_prompt(
                    parsed.body,
                    parsed.model,
                    lambda: ctx.hasher.hash_text(text, parsed.model, chunk_chars),
                    ctx.workers.routable(parsed.model),
                    request_for=endpoint.tokenize_request,
                )
                # wall, not CPU: a warm prompt never yields (all of it is the loop's), a cold one's
                # yields and encoder-thread time are in it, and so is a worker's /tokenize round trip
                state.stage_ns["tokenize"] = perf_counter_ns() - tokenizing
            state.prompt = prompt
        except GatewayError as e:
            state.refused = ("intake", e.code, e.message)
            flow.response = e.to_response()
