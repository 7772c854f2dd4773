"""Closed-form decode spans: the engine model's fast path (bench/sim/engine.py).

A run of pure-decode steps with an unchanged batch needs no per-step planning: Σctx grows by B (the batch
size) per step, so step i of the run lasts first + growth·i ms and the run's time is an arithmetic series.
`_decode_span` applies the longest such run that ends by the caller's time with no event, no KV shortage
and no admission; `_next_decode_finish_s` predicts the next finish by the same arithmetic, so
`next_event_s()` agrees with `advance()` to the bit. `Engine(reference=True)` bypasses both and must give
the same events (tests/unit/bench/test_engine.py).
"""

from __future__ import annotations

import math

from bench.sim.engine_state import EngineState
from bench.sim.engine_types import Span, Step
from bench.sim.profiles import step_time_ms


class DecodeSpans(EngineState):
    """The closed-form decode-span methods of the engine."""

    def _next_decode_finish_s(self) -> float | None:
        """The next event in closed form while only decoding is left: the earliest finish, by the same span
        arithmetic `_decode_span` will do. None when that does not apply (look ahead instead)."""
        step, running = self._pending, self._running
        if (step is not None and step.prefills) or not running:
            return None
        ahead = 1 if step is not None else 0  # a pending pure-decode step already holds its blocks
        left = math.inf
        ctx = 0
        for r in running:
            if r.computed < r.target:
                return None
            left = min(left, r.output - r.generated - ahead)
            ctx += r.prompt + r.generated + ahead
        if step is not None and left == 0:
            return step.end_s
        batch = len(running)
        if self._waiting and self._admission_hit(self._waiting[0], budget_used=batch) is not None:
            return None
        bs = self._bs
        need = sum(-(-(r.generated + ahead + left) // bs) + ((r.generated + ahead) // -bs) for r in running)
        if need > self._cache.free + self._cache.evictable:
            return None  # a preemption comes first
        start = step.end_s if step is not None else self._clock
        if left > 1:  # `left - 1` span steps, then the finishing step planned singly
            p = self.profile
            span = self._span
            if span is None:  # the span _decode_span would open after the pending step, if any
                first_ms = (
                    p.t0_ms
                    + max(p.t_w_ms + p.e_ms_per_seq * batch, p.b_ms_per_token * batch)
                    + p.f_ms_per_ctx_token * ctx
                )
                span = Span(start, first_ms, p.f_ms_per_ctx_token * batch, 0, 0, None)
            clock0, first_ms, growth_ms, done = span.clock0, span.first_ms, span.growth_ms, span.done
            total = done + int(left) - 1
            start = clock0 + (total * first_ms + growth_ms * total * (total - 1) / 2) / 1000.0
            ctx += (int(left) - 1) * batch
        return start + step_time_ms(self.profile, batch, ctx, 0, 0) / 1000.0

    def _decode_span(self, until_s: float) -> int:
        """Apply, in closed form, the longest run of pure-decode steps that ends by `until_s` with no event,
        no KV shortage and no admission; returns the number of steps (0 = take a single step instead)."""
        running = self._running
        span = self._span
        if span is None:
            batch = len(running)
            if batch == 0:
                return 0
            k = running[0].output  # > the steps any request has left
            ctx = 0
            for r in running:
                if r.computed < r.target:
                    return 0
                left = r.output - r.generated - 1  # the finishing step is taken singly
                if left < k:
                    k = left
                ctx += r.prompt + r.generated
            head = self._waiting[0] if self._waiting else None
            if head is not None and self._admission_hit(head, budget_used=batch) is not None:
                return 0
            if k > 0:
                k = self._steps_without_shortage(k)
            if k <= 0:
                return 0
            # The span's clock is always computed from this anchor, so it does not depend on where advance()
            # calls cut the span (and next_event_s() agrees with advance() to the bit).
            p = self.profile
            first_ms = (
                p.t0_ms
                + max(p.t_w_ms + p.e_ms_per_seq * batch, p.b_ms_per_token * batch)
                + p.f_ms_per_ctx_token * ctx
            )
            span = self._span = Span(self._clock, first_ms, p.f_ms_per_ctx_token * batch, 0, k, head)
        elif self._waiting and self._waiting[0] is not span.head:  # a new arrival heads the queue
            if self._admission_hit(self._waiting[0], budget_used=len(running)) is not None:
                return 0
            span.head = self._waiting[0]
        clock0, first_ms, growth_ms, done = span.clock0, span.first_ms, span.growth_ms, span.done
        k = span.limit - done
        if k <= 0:
            return 0
        within = (
            steps_within(first_ms, growth_ms, (until_s - clock0) * 1000.0) - done if until_s < math.inf else k
        )
        straddles = within <= 0  # the next step ends after until_s: commit it as a pending step of this span
        k = 1 if straddles else min(k, within)
        bs = self._bs
        grown = 0
        if straddles:  # one step, committed: a new decode block for each request at a block boundary
            for r in running:
                if r.generated % bs == 0:
                    r.private += 1
                    grown += 1
        else:
            for r in running:
                g = r.generated
                need = -(-(g + k) // bs) + (g // -bs)  # ceil((g+k)/bs) - ceil(g/bs) new decode blocks
                r.private += need
                grown += need
                r.generated = g + k
        self._private_total += grown
        self._cache.take(grown)
        total = span.done = done + k
        clock = clock0 + (total * first_ms + growth_ms * total * (total - 1) / 2) / 1000.0
        if straddles:
            self._pending = Step(clock, clock - self._clock, list(running), [])
            return 1
        self.busy_s += clock - self._clock
        self._clock = clock
        self.num_steps += k
        return k

    def _steps_without_shortage(self, k: int) -> int:
        """Largest k' <= k such that k' decode steps of the running batch get KV blocks without preempting."""
        avail = self._cache.free + self._cache.evictable
        bs = self._bs
        if len(self._running) * -(-k // bs) <= avail:
            return k

        def need(steps: int) -> int:
            return sum(-(-(r.generated + steps) // bs) + (r.generated // -bs) for r in self._running)

        lo, hi = 0, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= avail:
                lo = mid
            else:
                hi = mid - 1
        return lo


def steps_within(first_ms: float, growth_ms: float, window_ms: float) -> int:
    """Largest k with k·first + growth·k(k-1)/2 <= window (steps of an arithmetic series of durations)."""
    if window_ms < first_ms:
        return 0
    if growth_ms <= 0:
        k = int(window_ms // first_ms)
    else:
        lin = first_ms - growth_ms / 2
        k = int((-lin + math.sqrt(lin * lin + 2 * growth_ms * window_ms)) / growth_ms)
    while k > 0 and k * first_ms + growth_ms * k * (k - 1) / 2 > window_ms:
        k -= 1
    while (k + 1) * first_ms + growth_ms * (k + 1) * k / 2 <= window_ms:
        k += 1
    return k
