"""The response side of a request: stream it through metered, then release its slot exactly once.

`responseheaders` turns streaming on (an SSE body passes through chunk by chunk via `SseMeter`) and
adds the `x-kvgate-*` headers; `response` (finished) and `error` (upstream failure, client gone,
killed) both end the flow through `finish()`, which pops the lease from the flow state, so whichever
hook comes first releases it and the other finds nothing (MITMPROXY.md §2.5). Every Redis write
(release, decision record) runs in the background, and the outcome's metrics and record are built
after the response was written: these hooks stay near-instant because the last chunk is sent only
after `response` returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from time import perf_counter_ns
from typing import Any

from mitmproxy import http

from plugin.context import GatewayContext
from plugin.decision_log import Blocks
from plugin.flow import NOT_HELD, FlowState, body_of, header, put_headers, state_of
from plugin.metrics import outcome_of
from plugin.streaming import SseMeter, Usage

logger = logging.getLogger(__name__)
CONNECT_FAILURE_MARKERS = ("connect", "refused", "unreachable", "name or service")
# A client that leaves mid-stream: its worker keeps generating until it notices the closed upstream
# connection (its next write; vLLM checks between steps). The seat is held that much longer, so the
# request that gets it does not run beside the aborted one (running <= quota at the workers).
ABORT_GRACE_S = 0.25


class Release:
    """Response-path part: metering, response headers, slot release, outcome record."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        response = flow.response
        if state is None or response is None:
            return
        if self.ctx.config.gateway.response_headers:
            ours: list[tuple[str, str]] = []
            if state.route is not None:
                ours.append(("x-kvgate-worker", state.route.worker.id))
            if state.lease is not None or state.queued_s:
                ours.append(("x-kvgate-queued-ms", str(round(state.queued_s * 1000))))
            if state.session is not None and state.session.outcome:  # what the session did
                ours.append(("x-kvgate-session", state.session.outcome))
            if (held := state.held) is not None:  # which admission step held it
                ours.append(("x-kvgate-held-by", held.held_by))
                ours.append(("x-kvgate-reroutes", str(held.reroutes)))
            ours.append(("x-kvgate-request-id", state.request_id))
            put_headers(response.headers, ours)
        if state.route is None:
            return  # answered locally
        if (header(response, b"content-type") or "").startswith("text/event-stream"):
            parsed = state.parsed
            strip = bool(parsed and parsed.stream and not parsed.include_usage and state.usage_requested)
            route = state.route
            state.meter = SseMeter(
                strip_usage=strip, on_first_event=lambda: self.ctx.router.first_token(route)
            )
            response.stream = state.meter

    def response(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        if state is None:
            return
        status = flow.response.status_code if flow.response else 0
        self.finish(flow, state, status=status, error="")

    def error(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        if state is None:
            return
        message = flow.error.msg if flow.error else "error"
        refused = any(marker in message.lower() for marker in CONNECT_FAILURE_MARKERS)
        if state.route is not None and flow.response is None and refused:
            self.ctx.workers.suspect(state.route)
        lowered = message.lower()
        gone = "client disconnected" in lowered or (state.route is None and "killed" in lowered)
        status = 499 if gone else 502  # 499: the client left (nginx's convention)
        self.finish(flow, state, status=status, error=message)

    def finish(self, flow: http.HTTPFlow, state: FlowState, *, status: int, error: str) -> None:
        """End the flow's accounting; safe to call more than once (only the first call acts).

        The lease, the routing in-flight count and the session are settled now; the outcome's
        metrics and decision record are written once the response has gone out (they only describe
        it: `Releaser.after_response`), so they do not delay the response."""
        if state.finished:
            return
        state.finished = True
        started = perf_counter_ns()
        ctx = self.ctx
        state.status, state.error = status, error
        lease, state.lease = state.lease, None
        if lease is not None:
            if status == 499 and state.route is not None:
                asyncio.get_running_loop().call_later(ABORT_GRACE_S, ctx.releaser.release, lease)
            else:
                ctx.releaser.release(lease)
        if state.session is not None:
            ctx.sessions.finished(state.model, state.session)
        if state.parsed is not None and state.route is not None:
            ctx.router.finished(state.route)
        settled = perf_counter_ns() - started
        # a partial, not a lambda: no Python frame of its own when the step runs
        ctx.releaser.after_response(partial(self._account_timed, flow, state, status, error, settled))

    def _account_timed(self, flow: http.HTTPFlow, state: FlowState, status: int, error: str, ns: int) -> None:
        started = perf_counter_ns()
        self._account(flow, state, status, error)
        stages = state.stage_ns  # the request's stages, under its arm (plugin/metrics.py)
        stages["release"] = ns + perf_counter_ns() - started
        self.ctx.metrics.hot_path_cpu.add_request(state.model, state.arm, stages)

    def _account(self, flow: http.HTTPFlow, state: FlowState, status: int, error: str) -> None:
        """Count the outcome, write the decision record."""
        ctx = self.ctx
        metrics = ctx.metrics
        model, band = state.model, state.band_name  # model "" when refused before parsing
        tenant, arm = (state.caller.tenant if state.caller else ""), state.arm
        metrics.requests.inc(model, band, str(status), arm)
        metrics.outcomes.inc(model, tenant, band, outcome_of(status), arm)
        route = state.route
        if state.parsed is None or route is None:
            if state.refused is not None or state.parsed is not None:  # refused: one record too
                ctx.decisions.record(self._refusal_record(state, status, error), _blocks(state))
            return
        hits = route.view.prefix_hits
        hit = hits.get(route.worker.id, 0)
        metrics.reasons.inc(model, route.decision.kind, route.index_kind, arm)
        if hits:
            metrics.reachable_blocks.inc(model, arm, by=max(hits.values()))
            metrics.achieved_blocks.inc(model, arm, by=hit)
        metrics.duration.observe(time.monotonic() - state.received_at, model, arm)
        usage: Usage | None
        if state.meter is not None:
            usage = state.meter.finish()
        elif flow.response is not None and status < 400:
            content = body_of(flow.response)  # decoded on every access: once
            usage = state.parsed.endpoint.meter_body(content) if content is not None else None
        else:
            usage = None
        record = self._common_record(state, status, error)
        record.update(
            worker=route.worker.id,
            reason=route.decision.reason,
            reason_kind=route.decision.kind.value,
            candidates=route.decision.scores,  # not changed after the decision: serialized as is
            hits=route.view.prefix_hits,  # prefix blocks each worker is believed to hold
            prefix_blocks=len(route.view.prefix_hashes),
            hit_blocks=route.view.prefix_hits.get(route.worker.id, 0),
            index_match=route.index_kind,  # exact | speculative | approximate | none (policy/index.py)
            capacity_tokens=route.worker.capacity_tokens,
            prefix_rate=round(route.view.prefix_rate, 4),  # req/s of the sticky key (hot prefixes replicate)
            sticky_worker=route.view.sticky_worker,
        )
        record.update(state.held.record() if state.held is not None else NOT_HELD)
        # where the gateway's time went: its loop stages, then the moment it handed the request upstream
        # and the worker's response headers (each from the arrival)
        record["stage_us"] = {stage: round(ns / 1000, 1) for stage, ns in state.stage_ns.items()}
        if state.dispatched_at:
            record["gateway_ms"] = round((state.dispatched_at - state.received_at) * 1000, 3)
        if flow.response is not None and flow.response.timestamp_start:
            record["headers_ms"] = round(flow.response.timestamp_start * 1000 - record["arrival_ms"], 3)
        if state.session is not None:
            record["session"] = {
                "id": state.session.id, "outcome": state.session.outcome, "close": state.session.close,
                "bound_worker": state.session.binding.worker if state.session.binding else None,
            }  # fmt: skip
        if usage is not None:
            if usage.first_token_at is not None:
                ttft = usage.first_token_at - state.received_at
                record["ttft_ms"] = round(ttft * 1000, 3)
                if state.meter is not None:
                    metrics.ttft.observe(ttft, model, arm)
            record["output_tokens"] = usage.output_tokens
            metrics.output_tokens.inc(model, arm, by=usage.output_tokens)
            if usage.prompt_tokens is not None:
                record["prompt_tokens"] = usage.prompt_tokens
                metrics.prompt_tokens.inc(model, arm, by=usage.prompt_tokens)
                blocks = len(route.view.prefix_hashes)
                if blocks:
                    estimated = usage.prompt_tokens * min(hit, blocks) / blocks
                    metrics.estimated_cached.inc(model, route.worker.id, arm, by=estimated)
            if usage.cached_tokens is not None:
                record["cached_tokens"] = usage.cached_tokens
                metrics.cached_tokens.inc(model, arm, by=usage.cached_tokens)
                metrics.actual_cached.inc(model, route.worker.id, arm, by=usage.cached_tokens)
            if usage.prompt_tokens is not None and ctx.config.routing.hit_feedback:
                unlearnt = ctx.router.hit_feedback(route, usage.prompt_tokens, usage.cached_tokens)
                if unlearnt:
                    record["index_unlearnt"] = unlearnt
        ctx.decisions.record(record, _blocks(state))  # prefix_hashes and block_tokens: encoded apart

    def _common_record(self, state: FlowState, status: int, error: str) -> dict[str, Any]:
        """The decision record's fields every request has, routed or refused."""
        ctx = self.ctx
        latency_s = time.monotonic() - state.received_at
        prompt, parsed = state.prompt, state.parsed
        record: dict[str, Any] = {
            "request_id": state.request_id,
            "client_request_id": state.client_request_id,
            "gateway": ctx.gateway_id,
            "arrival_ms": round((time.time() - latency_s) * 1000, 3),  # wall clock
            "model": state.model,
            "tenant": state.caller.tenant if state.caller else "",
            "band": state.band_name,
            "arm": state.arm,
            "policy": ctx.router.arm_policies.get(state.arm, ""),
            "queued_ms": round(state.queued_s * 1000, 3),
            "status": status,
            "error": error,
            "latency_ms": round(latency_s * 1000, 3),
        }
        if parsed is not None:
            record["max_tokens"] = parsed.max_tokens
            record["stream"] = parsed.stream
        if prompt is not None:
            record["index"] = "exact" if prompt.exact else "approximate"
            record["prompt_tokens_est"] = prompt.prompt_tokens
            if ctx.config.decision_log.prompt_text and parsed is not None:
                record["prompt_text"] = parsed.endpoint.prefix_text(parsed.body)
        return record

    def _refusal_record(self, state: FlowState, status: int, error: str) -> dict[str, Any]:
        record = self._common_record(state, status, error)
        step, reason, detail = state.refused or ("", "", "")
        record.update(worker=None, refused_by=step, reason=reason, detail=detail)
        record.update(state.held.record() if state.held is not None else NOT_HELD)
        return record


def _blocks(state: FlowState) -> Blocks | None:
    """The record's `prefix_hashes` and `block_tokens` (plugin/decision_log.py encodes them)."""
    prompt = state.prompt
    return None if prompt is None else (prompt.hashes, prompt.block_tokens)
