"""Two-step admission for one request: a global seat (step one) on a worker with room (step two).

Routing runs first, from memory, so the slot script can check the chosen worker's capacity in the
same round trip as the quota (docs/ADMISSION.md "Two-step admission"):

    route -> acquire(ticket, worker=w)    1 round trip when a seat is free and w has room: placed on w
      w full (WorkerFull, nothing taken):
        reroute  route again without the full workers and acquire with that choice, up to
                 `reroute_attempts` more workers; when they are full too (or none is left): wait
        wait     wait for w
      no seat (queued): granted later without a worker; route again (the cluster changed meanwhile)
                 and place(lease, w'); w' full -> reroute: the next workers, then wait; wait: wait for w'
    waiting for a worker = hold a seat (acquire without a worker, in fair queue order if the quota
    is full) and place(lease, w) again at every sign that a worker of the model has room (a release
    of a placed lease by this process; a message from any gateway's release that took a worker from
    full to one free place: SlotPool.room_signal) and at least every WORKER_RECHECK_S; in
    wait mode w stays the chosen worker, in reroute mode w is the routing choice of the moment;
    within the request's wait budget, else WaitBudgetExceeded (429). A request that may not wait
    (budget 0) gets WorkerFull (503) when every worker tried is full.

A worker of unknown capacity (max_concurrency 0) is never full, and a lease granted after waiting is
not placed on it (no extra round trip): as before two-step admission. The routing reservation (this
gateway's in-flight count) is held only while the request is headed for a worker; the routing
history (prefix index, stickiness) is written once it is placed. If the request is cancelled (client
gone) or rejected, everything it took is given back: reservation, and lease (released once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass

from plugin.config import ModelSection
from plugin.context import GatewayContext
from plugin.flow import Held, Route, now_s
from policy.admission import door_wait_s, queue_too_deep
from store.slots import (
    AdmissionRejected,
    Lease,
    QueueTooDeep,
    SloUnreachable,
    Ticket,
    WaitBudgetExceeded,
    WorkerFull,
)

WORKER_RECHECK_S = 0.5  # re-check period while waiting for a worker (places freed by expired leases)


@dataclass(frozen=True, slots=True)
class Placed:
    """The outcome of both steps: the lease (placed on the route's worker when its capacity is known)."""

    lease: Lease
    route: Route
    held_by: str  # "" admitted at once; "quota" waited for a seat; "worker" a chosen worker was full
    reroutes: int  # workers tried after a full one
    worker_full: int  # workers that turned the request down

    def held(self) -> Held | None:
        """Which step held the request (None: placed at once on the first choice)."""
        return Held(self.held_by, self.reroutes, self.worker_full) if self.held_by else None


class Placement:
    """One request's way through both steps; `run()` once."""

    def __init__(
        self,
        ctx: GatewayContext,
        ticket: Ticket,
        section: ModelSection,
        plan: Callable[[Collection[str]], Route | None],
        ttft_slo_s: float | None = None,
    ) -> None:
        self.ctx = ctx
        self.ticket = ticket
        self.ttft_slo_s = ttft_slo_s
        self.plan = plan  # the routing choice without some workers, nothing reserved (Router.choose)
        self.reroute = section.on_worker_full == "reroute"
        self.attempts = section.reroute_attempts if self.reroute else 0
        self.deadline = now_s() + ticket.max_wait_s
        self.lease: Lease | None = None  # held, not yet handed to the flow
        self.route: Route | None = None  # reserved (Router.reserve), not yet handed to the flow
        self.held_by = ""
        self.reroutes = 0
        self.full = 0

    async def run(self) -> Placed | AdmissionRejected | None:
        """Placed, a rejection (nothing held), or None when no worker is routable."""
        try:
            result = await self._run()
        except AdmissionRejected as e:
            self._give_back()
            return e
        except BaseException:  # cancelled (the client left) or failed
            self._give_back()
            raise
        if result is None:
            self._give_back()
        return result

    async def _run(self) -> Placed | None:
        pool, ticket = self.ctx.pool, self.ticket
        tried: list[str] = []
        first = route = self._plan(tried)
        if first is not None:
            self._check_queue(first)
        if first is not None and self.ttft_slo_s is not None:
            self._check_slo(first, self.ttft_slo_s)
            ticket = self.ticket
        while route is not None:  # steps one and two in one round trip
            try:
                # not headed for the worker while queued for a seat: give the reservation back
                self.lease = await pool.acquire(ticket, worker=route.worker.id, on_queued=self._unreserve)
            except WorkerFull:
                tried.append(self._turned_down(route))
                route = self._next(tried)
                continue
            lease = self.lease
            if lease.worker is not None:
                return self._done(lease, route)
            self.held_by = "quota"  # granted after waiting: route again
            self._unreserve()  # (done already when the wait began)
            return await self._place(lease, first)
        if first is None:
            return None
        if ticket.max_wait_s <= 0:
            raise WorkerFull(f"every worker tried for {ticket.model} is full", retry_after_s=1, est_wait_s=0)
        self.lease = lease = await pool.acquire(ticket)  # a seat, to hold while waiting for the worker
        return await self._wait_for(lease, first, tried)

    def _check_queue(self, route: Route) -> None:
        """The engine-queue guard (policy.admission.queue_too_deep): refuse, nothing taken, when the
        chosen worker's predicted wait is over `[admission] max_queue_ms` (the best choice's: routing
        already weighs every worker's queue). Policies that predict no wait skip it."""
        admission = self.ctx.config.admission
        wait = door_wait_s(route.decision.scores.get(route.worker.id, {}), admission.queue_signal)
        max_queue_s = admission.max_queue_ms / 1000
        if wait is None or not queue_too_deep(self.ticket.band, wait, max_queue_s):
            return
        raise QueueTooDeep(
            f"predicted {admission.queue_signal} wait {wait:.3f} s on the best worker exceeds max_queue_ms "
            f"{max_queue_s * 1000:g}",
            retry_after_s=max(1.0, wait - max_queue_s),
            est_wait_s=wait,
        )

    def _check_slo(self, route: Route, slo_s: float) -> None:
        """SLO-aware early rejection: refuse when the chosen worker's predicted TTFT misses the SLO;
        else wait at most what the SLO leaves (a later start would miss it anyway). Policies that
        predict no TTFT (round_robin, least_loaded, article) skip it."""
        predicted = route.decision.scores.get(route.worker.id, {}).get("predicted-ttft")
        if predicted is None:
            return
        if predicted > slo_s:
            raise SloUnreachable(
                f"predicted time to first token {predicted:.3f} s on the best worker exceeds the SLO "
                f"{slo_s:.3f} s",
                retry_after_s=max(1.0, predicted - slo_s),
                est_wait_s=predicted,
            )
        budget_s = slo_s - predicted
        if budget_s < self.ticket.max_wait_s:
            self.ticket = dataclasses.replace(self.ticket, max_wait_s=budget_s)
            self.deadline = min(self.deadline, now_s() + budget_s)

    async def _place(self, lease: Lease, first: Route | None) -> Placed | None:
        """Place a lease granted after waiting: on the new routing choice, else per mode."""
        tried: list[str] = []
        route = self._plan(tried)
        first = route or first
        while route is not None:
            if route.worker.max_concurrency <= 0:  # capacity unknown: no step two
                return self._done(lease, route)
            try:
                self.lease = lease = await self.ctx.pool.place(lease, route.worker.id)
            except WorkerFull:
                tried.append(self._turned_down(route))
                route = self._next(tried)
                continue
            return self._done(lease, route)
        if first is None:
            return None
        return await self._wait_for(lease, first)

    async def _wait_for(self, lease: Lease, target: Route, found_full: Collection[str] = ()) -> Placed | None:
        """Hold the seat until a worker has room: `target`'s in wait mode; in reroute mode (and when
        `target` leaves the pool) the routing choice among the workers not found full since the last
        sign of room, so whichever worker has or gets a free place takes the request. A round of
        tries is bounded by `reroute_attempts` + 1; then it waits for the next sign."""
        pool, model = self.ctx.pool, self.ticket.model
        full = list(found_full)  # workers found full in this round
        signal = pool.room_signal(model)  # before trying: a release meanwhile is not missed
        if self.reroute and full and (chosen := self._choose(full)) is not None:
            target = chosen  # a worker not tried yet
        while True:
            if all(w.id != target.worker.id for w in self.ctx.workers.routable(model)):
                full.clear()
                if (chosen := self._choose(full)) is None:
                    return None
                target = chosen
            try:
                self.lease = lease = await pool.place(lease, target.worker.id)
            except WorkerFull:
                full.append(target.worker.id)
            else:
                self.ctx.router.reserve(target)
                self.route = target
                return self._done(lease, target)
            if self.reroute and len(full) <= self.attempts and (chosen := self._choose(full)) is not None:
                target = chosen  # another worker may have a free place now: no need to wait
                continue
            remaining = self.deadline - now_s()
            if remaining <= 0:
                raise WaitBudgetExceeded(
                    f"waited {self.ticket.max_wait_s:g} s for room on worker {target.worker.id}",
                    retry_after_s=1.0, est_wait_s=0.0,
                )  # fmt: skip
            await pool.room_freed(model, min(remaining, WORKER_RECHECK_S), signal)
            signal = pool.room_signal(model)
            full.clear()
            if self.reroute and (chosen := self._choose(full)) is not None:
                target = chosen

    def _choose(self, exclude: Collection[str]) -> Route | None:
        """The routing choice without `exclude`, not reserved (reserved once placed)."""
        return self.plan(exclude)

    # -- helpers -------------------------------------------------------------------------------------
    def _plan(self, exclude: Collection[str]) -> Route | None:
        """The routing choice without `exclude`, reserved at once (concurrent decisions see its load)."""
        self.route = self.plan(exclude)
        if self.route is not None:
            self.ctx.router.reserve(self.route)
        return self.route

    def _next(self, tried: list[str]) -> Route | None:
        """Reroute mode: the next choice without the full workers, within the attempts."""
        if not self.reroute or len(tried) > self.attempts:
            return None
        route = self._plan(tried)
        if route is not None:
            self.reroutes += 1
        return route

    def _turned_down(self, route: Route) -> str:
        """The route's worker is full: give its reservation back and count the event."""
        self._unreserve()
        self.held_by = "worker"
        self.full += 1
        self.ctx.metrics.worker_full.inc(route.model, route.worker.id)
        return route.worker.id

    def _unreserve(self) -> None:
        if self.route is not None:
            self.ctx.router.finished(self.route)
            self.route = None

    def _done(self, lease: Lease, route: Route) -> Placed:
        self.ctx.router.record_soon(route)  # after the request is sent to its worker
        self.lease = self.route = None  # the flow owns them now (released by plugin/release.py)
        return Placed(lease, route, self.held_by, self.reroutes, self.full)

    def _give_back(self) -> None:
        self._unreserve()
        if self.lease is not None:
            self.ctx.releaser.release(self.lease)
            self.lease = None
