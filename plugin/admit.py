"""Admission, the second child on a completion request: hold it until it has a global slot.

The slot pool (plugin/slots.py) takes a slot in one Redis round trip when one is free, else queues
the request in the global priority queue that all gateways share. While it waits, the request's
client may leave: `KvGate.client_disconnected` cancels the wait (the pool is cancellation-safe: the
waiter leaves the queue and a slot granted in the race is released) and the flow is killed, so it
never reaches a worker. A full queue or an exhausted wait budget answers 429 with `Retry-After`
and the estimated wait. Under sustained pressure (policy/pressure.py) a low-priority request is shed
at the door: 429 `shed` with an `x-kvgate-shed` header, before it takes a seat or a queue place.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from mitmproxy import http

from plugin.context import accepted, fail_closed, now_s
from plugin.errors import GatewayError
from plugin.slots import AdmissionRejected, Lease, SlotPool, Ticket
from plugin.tasks import spawn
from policy.admission import seat_count

if TYPE_CHECKING:
    from plugin.addon import KvGate
    from plugin.routing import Prompt


async def acquire_or_rejection(pool: SlotPool, ticket: Ticket) -> Lease | AdmissionRejected:
    """The lease, or the rejection as a value (a task's expected outcome, not an error to log)."""
    try:
        return await pool.acquire(ticket)
    except AdmissionRejected as e:
        return e


class Admission:
    """Child addon: take a slot lease for the request (one Redis round trip when free)."""

    def __init__(self, gate: KvGate) -> None:
        self.gate = gate

    @fail_closed
    async def request(self, flow: http.HTTPFlow) -> None:
        if (found := accepted(flow)) is None:
            return
        state, parsed, caller = found
        gate = self.gate
        prompt: Prompt = state.extra["prompt"]
        ticket = Ticket(
            request_id=state.request_id,
            model=parsed.model,
            band=caller.band,
            tenant=caller.tenant,
            seats=self.seats(parsed.model, prompt, parsed.max_tokens),
            max_wait_s=caller.max_wait_s,
        )
        started = now_s()
        shed_after_s = gate.config.admission.shed_low_after_ms / 1000
        if gate.pressure.sheds(parsed.model, caller.band, started, shed_after_s):
            gate.metrics.rejected.inc(parsed.model, "shed")
            flow.response = shed_response(gate.pressure.pressure_s(parsed.model, started))
            return
        client = flow.client_conn
        if client.timestamp_end is not None:  # left before we got here
            _kill(flow)
            return
        task = spawn(acquire_or_rejection(gate.pool, ticket), name=f"kvgate-acquire-{state.request_id}")
        waiting = gate.waiters.setdefault(client.id, set())
        waiting.add(task)
        gate.queued[parsed.model] = gate.queued.get(parsed.model, 0) + 1
        try:
            await asyncio.wait({task})
        finally:
            waiting.discard(task)
            if not waiting:
                gate.waiters.pop(client.id, None)
            gate.queued[parsed.model] -= 1
        if task.cancelled():  # the client disconnected while queued
            gate.metrics.rejected.inc(parsed.model, "client_gone")
            _kill(flow)
            return
        result = task.result()
        if isinstance(result, AdmissionRejected):
            gate.metrics.rejected.inc(parsed.model, result.reason)
            raise_as_response(flow, result)
            return
        state.lease = result
        state.queued_s = now_s() - started
        gate.metrics.admission_wait.observe(state.queued_s, parsed.model, state.band_name)

    def seats(self, model: str, prompt: Prompt, max_tokens: int) -> int:
        """Seats by cost: uncached prompt (best prefix hit among workers) + max_tokens; 1 when the
        model's quota counts requests (the default)."""
        section = self.gate.config.models.get(model)
        if section is None or not section.count_seats:
            return 1
        hit_tokens = self.gate.router.best_hit_tokens(model, prompt)
        return seat_count(prompt.prompt_tokens - hit_tokens, max_tokens)


def raise_as_response(flow: http.HTTPFlow, rejected: AdmissionRejected) -> None:
    status = rejected.status if rejected.status in (429, 503) else 429
    est = round(float(rejected.est_wait_s), 3)
    flow.response = GatewayError(
        status,
        rejected.reason,
        f"admission rejected ({rejected.reason}); estimated wait {est} s",
        retry_after_s=max(rejected.retry_after_s, 1.0),
        extra={"estimated_wait_s": est},
    ).to_response()


def shed_response(pressure_s: float) -> http.Response:
    response = GatewayError(
        429,
        "shed",
        f"low-priority traffic is shed: higher-priority requests have been queued for {pressure_s:.0f} s "
        "(sustained overload); retry later",
        retry_after_s=max(pressure_s, 1.0),
    ).to_response()
    response.headers["x-kvgate-shed"] = "low-priority"
    return response


def _kill(flow: http.HTTPFlow) -> None:
    if flow.killable:
        flow.kill()
