"""Admission, the second child on a completion request: a global slot on a worker with room.

Two-step admission (plugin/placement.py): the request is routed first (memory only), then the slot
pool (store/slots.py) takes a seat and checks the chosen worker's capacity in one Redis round trip
when both have room. Otherwise the request waits in the global priority queue that all gateways
share, or for a worker (rerouted first, per model: `on_worker_full`). While it waits, the request's
client may leave: `KvGate.client_disconnected` cancels the wait (the pool is cancellation-safe: the
waiter leaves the queue, a slot granted in the race or held while waiting for a worker is released)
and the flow is killed, so it never reaches a worker. A full queue or an exhausted wait budget
answers 429 with `Retry-After` and the estimated wait.
Under sustained pressure (policy/pressure.py) a low-priority request is shed at the door: 429
`shed` with an `x-kvgate-shed` header, before it takes a seat or a queue place.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from mitmproxy import http

from plugin.config import ModelSection
from plugin.context import accepted, fail_closed, now_s
from plugin.errors import GatewayError
from plugin.placement import Placed, Placement
from store.slots import AdmissionRejected, Ticket

if TYPE_CHECKING:
    from plugin.addon import KvGate
    from plugin.routing import Prompt


DEFAULT_MODEL = ModelSection()


class Admission:
    """Child addon: route, then take a slot lease on that worker (one Redis round trip when free)."""

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
        section = gate.config.models.get(parsed.model, DEFAULT_MODEL)
        placement = Placement(
            gate,
            ticket,
            section,
            lambda exclude: gate.dispatch.plan(state, parsed, caller, exclude),
            ttft_slo_s=caller.ttft_slo_s,
        )
        # No task of its own: the hook's task awaits the placement (one round trip when free), and a
        # client that leaves meanwhile cancels that task (KvGate.client_disconnected), which the
        # placement gives everything back for; the cancellation is then taken back here.
        me = asyncio.current_task()
        if me is None:
            raise RuntimeError("the admission hook must run in a task")
        waiting = gate.waiters.setdefault(client.id, set())
        waiting.add(me)
        gate.queued[parsed.model] = gate.queued.get(parsed.model, 0) + 1
        try:
            result = await placement.run()
        except asyncio.CancelledError:
            if me not in gate.disconnected:
                raise
            gate.disconnected.discard(me)
            me.uncancel()
            gate.metrics.rejected.inc(parsed.model, "client_gone")
            _kill(flow)
            return
        finally:
            gate.disconnected.discard(me)
            waiting.discard(me)
            if not waiting and gate.waiters.get(client.id) is waiting:
                del gate.waiters[client.id]
            gate.queued[parsed.model] -= 1
        if result is None:
            flow.response = GatewayError(
                503, "no_healthy_worker", f"no healthy worker for {parsed.model!r}", retry_after_s=1
            ).to_response()
            return
        if isinstance(result, AdmissionRejected):
            gate.metrics.rejected.inc(parsed.model, result.reason)
            raise_as_response(flow, result)
            return
        state.lease, state.route = result.lease, result.route
        state.queued_s = now_s() - started
        if result.held_by:
            state.extra["admission"] = held_record(result)
        gate.metrics.admission_wait.observe(state.queued_s, parsed.model, state.band_name)

    def seats(self, model: str, prompt: Prompt, max_tokens: int) -> int:
        """Seats by cost: uncached prompt (best prefix hit among workers) + max_tokens, in the model's
        `tokens_per_seat`; 1 when the model's quota counts requests (the default)."""
        section = self.gate.config.models.get(model)
        if section is None or not section.count_seats:
            return 1
        hit_tokens = self.gate.router.best_hit_tokens(model, prompt)
        return section.seats(prompt.prompt_tokens - hit_tokens, max_tokens)


def held_record(placed: Placed) -> dict[str, object]:
    """Which step held the request, for the decision record and the response headers."""
    return {"held_by": placed.held_by, "reroutes": placed.reroutes, "worker_full": placed.worker_full}


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
