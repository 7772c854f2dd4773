"""Admission, the second part on a completion request: a global slot on a worker with room.

Two-step admission (plugin/placement.py): the request is routed first (memory only), then the slot
pool (store/slots.py) takes a seat and checks the chosen worker's capacity in one Redis round trip
when both have room. Otherwise the request waits in the global priority queue that all gateways
share, or for a worker (rerouted first, per model: `on_worker_full`). While it waits, the request's
client may leave: `ProcessState.client_left` (the addon's `client_disconnected`) cancels the wait
(the pool is cancellation-safe: the waiter leaves the queue, a slot granted in the race or held while
waiting for a worker is released) and the flow is killed, so it never reaches a worker. A full queue
or an exhausted wait budget answers 429 with `Retry-After` and the estimated wait.
Under sustained pressure (policy/pressure.py) a low-priority request is shed at the door: 429
`shed` with an `x-kvgate-shed` header, before it takes a seat or a queue place.
With `gateway.redis_failure = "open"`, a request that finds Redis unreachable is admitted within this
gateway's local share of the quota instead (plugin/open_admission.py), or answered 503 past it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from time import perf_counter_ns

from mitmproxy import http
from redis.exceptions import RedisError

from plugin.config import ModelSection
from plugin.context import GatewayContext
from plugin.errors import GatewayError
from plugin.flow import Accepted, Prompt, Route, SessionRef, accepted, fail_closed, now_s
from plugin.open_admission import OpenShare
from plugin.placement import Placed, Placement
from store.slots import AdmissionRejected, Ticket

DEFAULT_MODEL = ModelSection()
logger = logging.getLogger(__name__)


class Admission:
    """Request-path part: route, then take a slot lease on that worker (one Redis round trip when free)."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    @fail_closed
    async def request(self, flow: http.HTTPFlow) -> None:
        if (found := accepted(flow)) is None:
            return
        state, parsed, caller = found.state, found.parsed, found.caller
        ctx, process = self.ctx, self.ctx.process
        cpu_started = perf_counter_ns()  # the admit stage: this hook's own code before the placement
        ticket = Ticket(
            request_id=state.request_id,
            model=parsed.model,
            band=caller.band,
            tenant=caller.tenant,
            seats=self.seats(parsed.model, found.prompt, parsed.max_tokens),
            max_wait_s=caller.max_wait_s,
        )
        state.arm = ctx.router.arm(caller.tenant, found.prompt)
        started = now_s()
        shed_after_s = ctx.config.admission.shed_low_after_ms / 1000
        if ctx.pressure.sheds(parsed.model, caller.band, started, shed_after_s):
            ctx.metrics.rejected.inc(parsed.model, "shed", state.arm)
            state.refused = ("shed", "shed", "low-priority traffic shed under sustained pressure")
            flow.response = shed_response(ctx.pressure.pressure_s(parsed.model, started))
            return
        client = flow.client_conn
        if client.timestamp_end is not None:  # left before we got here
            _kill(flow)
            return
        if state.session is not None:  # its binding, for the routing choice (policy/session.py)
            so_far = perf_counter_ns() - cpu_started
            await self._session_lookup(parsed.model, state.session)
            cpu_started = perf_counter_ns() - so_far  # the await is not this stage's CPU
        section = ctx.config.models.get(parsed.model, DEFAULT_MODEL)
        placement = Placement(
            ctx, ticket, section, lambda exclude: self.plan(found, exclude), ttft_slo_s=caller.ttft_slo_s
        )
        # No task of its own: the hook's task awaits the placement (one round trip when free), and a
        # client that leaves meanwhile cancels that task (ProcessState.client_left), which the
        # placement gives everything back for; the cancellation is then taken back here.
        me = asyncio.current_task()
        if me is None:
            raise RuntimeError("the admission hook must run in a task")
        waiting = process.waiters.setdefault(client.id, set())
        waiting.add(me)
        process.queued[parsed.model] = process.queued.get(parsed.model, 0) + 1
        state.stage_ns["admit"] = perf_counter_ns() - cpu_started  # up to the placement's round trip
        try:
            result = await self._placed(placement, found, ticket)
        except asyncio.CancelledError:
            if me not in process.disconnected:
                raise
            process.disconnected.discard(me)
            me.uncancel()
            ctx.metrics.rejected.inc(parsed.model, "client_gone", state.arm)
            _kill(flow)
            return
        finally:
            process.disconnected.discard(me)
            waiting.discard(me)
            if not waiting and process.waiters.get(client.id) is waiting:
                del process.waiters[client.id]
            process.queued[parsed.model] -= 1
        if result is None or isinstance(result, AdmissionRejected):
            state.queued_s = now_s() - started
        if result is None:
            state.refused = ("routing", "no_healthy_worker", "no routable worker left")
            flow.response = GatewayError(
                503, "no_healthy_worker", f"no healthy worker for {parsed.model!r}", retry_after_s=1
            ).to_response()
            return
        if isinstance(result, AdmissionRejected):
            ctx.metrics.rejected.inc(parsed.model, result.reason, state.arm)
            detail = f"{result}; estimated wait {result.est_wait_s:.3f} s"
            state.refused = ("admission", result.reason, detail)
            raise_as_response(flow, result)
            return
        state.lease, state.route = result.lease, result.route
        if state.session is not None:
            ctx.sessions.routed(result.route, state.session)
        state.queued_s = now_s() - started
        state.held = result.held()
        ctx.metrics.admission_wait.observe(state.queued_s, parsed.model, state.band_name, state.arm)

    async def _placed(
        self, placement: Placement, found: Accepted, ticket: Ticket
    ) -> Placed | AdmissionRejected | None:
        """Both steps in Redis; in open mode, the local share when Redis fails (or failed just now)."""
        share = self.ctx.open_share
        if share is None:
            return await placement.run()
        if not share.skip_redis():
            try:
                return await placement.run()
            except (RedisError, OSError) as e:  # (placement gave back what it held)
                share.failed()
                logger.debug("request %s: Redis failed (%s); local share", ticket.request_id, e)
        return self._admit_locally(share, found, ticket)

    def _admit_locally(
        self, share: OpenShare, found: Accepted, ticket: Ticket
    ) -> Placed | AdmissionRejected | None:
        """Redis is unreachable: the routing choice on the mirror, within this gateway's share."""
        route = self.plan(found)
        if route is None:
            return None
        try:
            lease = share.admit(ticket, route.worker.id)
        except AdmissionRejected as e:
            self.ctx.metrics.open_admissions.inc(ticket.model, "share_full")
            return e
        self.ctx.metrics.open_admissions.inc(ticket.model, "admitted")
        self.ctx.router.reserve(route)
        self.ctx.router.record_soon(route)
        return Placed(lease, route, "", 0, 0)

    async def _session_lookup(self, model: str, ref: SessionRef) -> None:
        """The session's binding; in open mode, none while Redis is unreachable (routed on its own)."""
        share = self.ctx.open_share
        if share is not None and share.skip_redis():
            return
        try:
            await self.ctx.sessions.lookup(model, ref)
        except (RedisError, OSError):
            if share is None:
                raise
            share.failed()

    def plan(self, found: Accepted, exclude: Collection[str] = ()) -> Route | None:
        """The policy's choice among the routable workers minus `exclude`, nothing reserved
        (placement reserves it); None when no worker is left."""
        parsed, caller = found.parsed, found.caller
        workers = self.ctx.workers.routable(parsed.model)
        if exclude:
            workers = [w for w in workers if w.id not in exclude]
        session = found.state.session
        started = perf_counter_ns()  # the route stage (again for a request rerouted off a full worker)
        route = self.ctx.router.choose(
            request_id=found.state.request_id, model=parsed.model, prompt=found.prompt,
            max_tokens=parsed.max_tokens, band=caller.band, tenant=caller.tenant, workers=workers,
            arm=found.state.arm,
            session=session.binding if session is not None else None, streamed=parsed.stream,
        )  # fmt: skip
        stages = found.state.stage_ns
        stages["route"] = stages.get("route", 0) + perf_counter_ns() - started
        return route

    def seats(self, model: str, prompt: Prompt, max_tokens: int) -> int:
        """Seats by cost: uncached prompt (best prefix hit among workers) + max_tokens, in the model's
        `tokens_per_seat`; 1 when the model's quota counts requests (the default)."""
        section = self.ctx.config.models.get(model)
        if section is None or not section.count_seats:
            return 1
        hit_tokens = self.ctx.router.best_hit_tokens(model, prompt)
        return section.seats(prompt.prompt_tokens - hit_tokens, max_tokens)


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
