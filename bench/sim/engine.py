"""Model of ONE continuous-batching, prefix-caching GPU worker (vLLM V1 defaults), in virtual time.

Pure, synchronous and deterministic: time is a parameter, nothing is random. The simulator drives it in
virtual time (bench/sim/cluster.py); the emulated vLLM worker drives it in scaled real time to decide when
to stream tokens (bench/emulator/). Contract: `submit`, `abort`, `advance(until_s) -> [events]`,
`next_event_s()`, `progress()`, plus vLLM-named state (`running`, `waiting`, `kv_usage`, cache counters).

Model (shared/reference/ENGINE.md §3, §8; each point is a deliberate simplification of vLLM V1):
* KV pool of `num_gpu_blocks` engine blocks. A prompt is a chain of cache blocks (key, tokens); a block costs
  ceil(tokens / block_size) engine blocks. Cached blocks are ref-counted while running requests use them
  (pinned); unpinned cached blocks sit in an LRU queue, appended tail-first when freed, so on equal recency
  the deeper block of a prefix is evicted first (vLLM frees a request's blocks in reverse order).
  Pool and prefix cache: bench/sim/kv_cache.py.
* Never-used capacity is taken before any cached block is evicted.
* A request is admitted (FCFS, head-of-line blocking as vLLM) when a slot (max_num_seqs), step budget and
  KV fit: its uncached prompt blocks plus its first decode block are reserved at admission, so prefill never
  preempts. The prefix hit is the longest run of leading cached blocks at admission time; a full hit still
  recomputes the last block (vLLM never hits the last prompt token). Blocks become cached as soon as a chunk
  has computed them; a block that another request cached meanwhile is shared and the private copy freed.
* Per step: every decoding request takes 1 token (and a new engine block every block_size tokens), then
  running prefills continue in admission order, then waiting requests are admitted; chunked prefill fills the
  budget `max_num_batched_tokens`. The step that completes a prefill yields a token (the first one).
* Decode growth with an exhausted pool preempts the most recently admitted running request (recompute: its
  blocks are freed, it goes back to the head of the waiting queue, keeps its generated tokens and later
  prefills prompt + generated again). No admission happens in a step that preempted. A lone request that
  cannot fit is run anyway (over-commit) rather than deadlock; the profiles make that unreachable in practice.
* Step time (ms): t0 + max(t_w + e·B, b·N) + c·Σ n_i·(ctx_i + n_i/2) + f·Σ ctx_j  (bench/sim/profiles.py).

Steps are committed at their start and take effect at their end: `advance(until_s)` applies steps that end
by `until_s` and leaves a step that straddles it pending, so a request submitted at `until_s` joins the next
step.
Speed: a run of pure-decode steps with an unchanged batch is applied in closed form (Σctx grows by B per step,
so the span's time is an arithmetic series); `reference=True` steps one at a time and must give the same
events (tests/unit/bench/test_engine.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from bench.sim.kv_cache import PrefixCache
from bench.sim.profiles import EngineProfile, step_time_ms

RequestId = str | int

_WAITING, _RUNNING, _ENDED = 0, 1, 2
_DONE_MEMORY = 100_000  # finished ids remembered for progress()


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A prompt as chained cache blocks (key identifies the whole prefix up to the block, tokens) + output."""

    id: RequestId
    blocks: tuple[tuple[Hashable, int], ...]
    output_tokens: int


@dataclass(frozen=True, slots=True)
class FirstToken:
    id: RequestId
    at_s: float
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True, slots=True)
class Finished:
    id: RequestId
    at_s: float
    output_tokens: int


EngineEvent = FirstToken | Finished


class _Req:
    """Mutable scheduling state of one request."""

    __slots__ = (
        "cached_tokens", "computed", "cum", "first_done", "generated", "held", "id", "keys", "output",
        "private", "prompt", "sizes", "state", "target",
    )  # fmt: skip

    def __init__(self, req: EngineRequest, block_size: int) -> None:
        self.id = req.id
        keys, tokens = zip(*req.blocks, strict=True)
        self.keys: tuple[Hashable, ...] = keys
        self.sizes = tuple([-(-t // block_size) for t in tokens])  # engine blocks per cache block
        self.cum = tuple(accumulate(tokens))  # prompt tokens up to and including each block
        self.prompt: int = self.cum[-1]
        self.output = req.output_tokens
        self.generated = 0  # output tokens produced so far
        self.computed = 0  # tokens of the current prefill in KV (hits included)
        self.target = 0  # tokens the current prefill must reach (prompt + generated at admission)
        self.held = 0  # leading prompt blocks this request pins in the cache
        self.private = 0  # engine blocks reserved outside the cache (uncached prompt blocks + decode)
        self.cached_tokens = -1  # set at the first admission, as vLLM's num_cached_tokens
        self.first_done = False
        self.state = _WAITING

    def copy(self) -> _Req:
        twin = _Req.__new__(_Req)
        twin.id, twin.keys, twin.sizes, twin.cum, twin.prompt = (
            self.id,
            self.keys,
            self.sizes,
            self.cum,
            self.prompt,
        )
        twin.output, twin.generated, twin.computed, twin.target = (
            self.output,
            self.generated,
            self.computed,
            self.target,
        )
        twin.held, twin.private, twin.cached_tokens = self.held, self.private, self.cached_tokens
        twin.first_done, twin.state = self.first_done, self.state
        return twin


@dataclass(slots=True)
class _Span:
    """A run of pure-decode steps of an unchanged batch: step i (from 0) of it lasts first + growth·i ms."""

    clock0: float  # when its first step started
    first_ms: float
    growth_ms: float  # f·B: Σctx grows by one token per sequence per step
    done: int  # steps taken (applied, or committed as the pending step)
    limit: int  # steps it may take before a request finishes or the KV pool runs short
    head: _Req | None  # head of the waiting queue, known not to be admissible during the span


@dataclass(slots=True)
class _Step:
    end_s: float
    duration_s: float
    decodes: list[_Req]
    prefills: list[tuple[_Req, int]]


class Engine:
    """One simulated worker; see the module docstring for the model and the driving contract."""

    def __init__(
        self, profile: EngineProfile, *, record_kv_events: bool = False, reference: bool = False
    ) -> None:
        self.profile = profile
        self.reference = reference
        self._bs = profile.block_size
        self._cache = PrefixCache(profile.num_gpu_blocks, record_kv_events)
        self._running: list[_Req] = []  # admission order
        self._waiting: deque[_Req] = deque()
        self._live: dict[RequestId, _Req] = {}
        self._done: OrderedDict[RequestId, int] = OrderedDict()
        self._pending: _Step | None = None
        self._buffer: list[EngineEvent] = []  # events produced past the caller's last advance()
        self._clock = 0.0  # when the engine is free to start its next step
        self._private_total = 0
        self._next_event_memo: tuple[float | None] | None = None
        self._span: _Span | None = None  # the run of pure-decode steps in progress
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.num_steps = 0
        self.busy_s = 0.0

    # ---- driving -------------------------------------------------------------------------------------

    def submit(self, req: EngineRequest, now_s: float) -> None:
        """The request arrives in the waiting queue at `now_s` (>= the last `advance` time)."""
        if req.id in self._live:
            raise ValueError(f"request {req.id!r} is already in the engine")
        if not req.blocks or req.output_tokens < 1 or any(t < 1 for _, t in req.blocks):
            raise ValueError(
                f"request {req.id!r} needs >= 1 prompt block of >= 1 token and output_tokens >= 1"
            )
        self._catch_up(now_s)
        r = _Req(req, self._bs)
        self._live[r.id] = r
        self._waiting.append(r)
        if self._pending is None and len(self._waiting) == 1 and not self._running:
            self._clock = max(self._clock, now_s)  # idle engine: time jumps to the arrival
        self._next_event_memo = None

    def abort(self, req_id: RequestId, now_s: float) -> None:
        """The client went away: drop the request and free its blocks; no event. Unknown ids are ignored."""
        self._catch_up(now_s)
        r = self._live.pop(req_id, None)
        if r is None:
            return
        if r.state == _RUNNING:
            self._release(r)
            self._running.remove(r)
            self._span = None
        else:
            self._waiting.remove(r)
        r.state = _ENDED
        self._next_event_memo = None

    def advance(self, until_s: float) -> list[EngineEvent]:
        """Run the engine up to `until_s`; returns the events that happened by then, in time order."""
        self._catch_up(until_s)
        ready = [ev for ev in self._buffer if ev.at_s <= until_s]
        self._buffer = self._buffer[len(ready) :]
        return ready

    def next_event_s(self) -> float | None:
        """Time of the next FirstToken/Finished if nothing new arrives (None when there is nothing to do)."""
        if self._buffer:
            return self._buffer[0].at_s
        if self._next_event_memo is None:
            if not self._running and not self._waiting and self._pending is None:
                at_s: float | None = None
            elif self.reference or (at_s := self._next_decode_finish_s()) is None:
                events = self._clone()._run(math.inf, stop_at_event=True)  # look ahead on a copy
                at_s = events[0].at_s if events else None
            self._next_event_memo = (at_s,)
        return self._next_event_memo[0]

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
                span = _Span(start, first_ms, p.f_ms_per_ctx_token * batch, 0, 0, None)
            clock0, first_ms, growth_ms, done = span.clock0, span.first_ms, span.growth_ms, span.done
            total = done + int(left) - 1
            start = clock0 + (total * first_ms + growth_ms * total * (total - 1) / 2) / 1000.0
            ctx += (int(left) - 1) * batch
        return start + step_time_ms(self.profile, batch, ctx, 0, 0) / 1000.0

    def _catch_up(self, until_s: float) -> None:
        memo = self._next_event_memo
        if memo is not None and memo[0] is not None and memo[0] <= until_s:
            self._next_event_memo = None  # spans may round differently from the look-ahead; recompute
        events = self._run(until_s)
        if events:
            self._buffer.extend(events)
            self._next_event_memo = None

    # ---- state ---------------------------------------------------------------------------------------

    def progress(self, req_id: RequestId, now_s: float) -> int:
        """Output tokens generated by `req_id` as of the last advance() (`now_s` >= that time)."""
        r = self._live.get(req_id)
        if r is not None:
            return r.generated
        if req_id in self._done:
            return self._done[req_id]
        raise KeyError(req_id)

    @property
    def running(self) -> int:
        """vllm:num_requests_running"""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """vllm:num_requests_waiting"""
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """vllm:kv_cache_usage_perc: engine blocks used by running requests / pool (0..1)."""
        return min(1.0, (self._cache.pinned + self._private_total) / self.profile.num_gpu_blocks)

    def cached_prefix_blocks(self, blocks: Sequence[tuple[Hashable, int]] | Sequence[Hashable]) -> int:
        """Leading blocks present in the prefix cache now. Accepts EngineRequest.blocks-style (key, tokens)
        pairs or bare keys; a bare key must not itself be a (hashable, int) pair (use cached_prefix_keys)."""
        if blocks and isinstance(blocks[0], tuple) and len(blocks[0]) == 2 and isinstance(blocks[0][1], int):
            size = self._cache.size
            n = 0
            for pair in blocks:
                if pair[0] not in size:  # type: ignore[index]
                    break
                n += 1
            return n
        return self.cached_prefix_keys(blocks)

    def cached_prefix_keys(self, keys: Sequence[Hashable]) -> int:
        """Leading keys present in the prefix cache now (does not touch recency)."""
        size = self._cache.size
        n = 0
        for key in keys:
            if key not in size:
                break
            n += 1
        return n

    def drain_kv_events(self) -> list[tuple[str, list[Hashable]]]:
        """("stored" | "removed" | "cleared", keys) since the last call (record_kv_events=True only)."""
        events = self._cache.events
        if events is None:
            return []
        self._cache.events = []
        return events

    def clear_cache(self) -> None:
        """Like vLLM reset_prefix_cache: drop every unpinned cached block (emits "cleared")."""
        self._cache.clear()
        self._next_event_memo = None

    # ---- the scheduler -------------------------------------------------------------------------------

    def _run(self, until_s: float, stop_at_event: bool = False) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        while True:
            step = self._pending
            if step is not None:
                if step.end_s > until_s:
                    break
                self._pending = None
                self._clock = step.end_s
                self.busy_s += step.duration_s
                self.num_steps += 1
                self._apply(step, events)
                if stop_at_event and events:
                    break
                continue
            if not self._running and not self._waiting:
                break
            if self._clock >= until_s:
                break
            if not self.reference and self._decode_span(until_s):
                continue
            self._pending = self._plan(self._clock)
        return events

    def _plan(self, start_s: float) -> _Step:
        """Choose the next step's work at its start: decodes, prefill chunks, admissions (vLLM V1 order)."""
        self._span = None
        p = self.profile
        running, bs = self._running, self._bs
        decodes: list[_Req] = []
        prefilling: list[_Req] = []
        decode_ctx = 0
        preemptions = self.num_preemptions
        i = 0
        while i < len(running):  # _grow preempts from the end, never a request already looked at
            r = running[i]
            i += 1
            if r.computed < r.target:
                prefilling.append(r)
            elif r.generated % bs or self._grow(r):
                decodes.append(r)
                decode_ctx += r.prompt + r.generated
        budget = p.max_num_batched_tokens - len(decodes)
        prefills: list[tuple[_Req, int]] = []
        new_tokens = 0
        attn = 0.0
        for r in prefilling:
            if budget <= 0:
                break
            n = min(r.target - r.computed, budget)
            prefills.append((r, n))
            new_tokens += n
            attn += n * (r.computed + n / 2)
            budget -= n
        if self.num_preemptions == preemptions:  # vLLM admits nothing in a step that preempted
            waiting = self._waiting
            while waiting and budget > 0 and len(running) < p.max_num_seqs:
                r = waiting[0]
                hit = self._admission_hit(r)
                if hit is None:
                    break
                waiting.popleft()
                self._admit(r, hit)
                n = min(r.target - r.computed, budget)
                prefills.append((r, n))
                new_tokens += n
                attn += n * (r.computed + n / 2)
                budget -= n
        duration_s = step_time_ms(p, len(decodes), decode_ctx, new_tokens, attn) / 1000.0
        return _Step(start_s + duration_s, duration_s, decodes, prefills)

    def _apply(self, step: _Step, events: list[EngineEvent]) -> None:
        """The step ends: tokens appear, computed blocks become cached, finished requests leave."""
        at_s = step.end_s
        ended = False
        for r in step.decodes:
            if r.state == _RUNNING:
                r.generated += 1
                if r.generated >= r.output:
                    self._finish(r, at_s, events)
                    ended = True
        for r, n in step.prefills:
            if r.state != _RUNNING:
                continue
            r.computed += n
            self._cache_computed_blocks(r)
            if r.computed >= r.target:
                r.generated += 1
                if not r.first_done:
                    r.first_done = True
                    events.append(FirstToken(r.id, at_s, r.cached_tokens))
                if r.generated >= r.output:
                    self._finish(r, at_s, events)
                    ended = True
        if ended:
            self._running = [r for r in self._running if r.state == _RUNNING]

    def _decode_span(self, until_s: float) -> int:
        """Apply, in closed form, the longest run of pure-decode steps that ends by `until_s` with no event,
        no KV shortage and no admission; returns the number of steps (0 = take a single step instead)."""
        running = self._running
        span = self._span
        if span is None:
            batch = len(running)
            if batch == 0:
                return 0
            steps = math.inf
            ctx = 0
            for r in running:
                if r.computed < r.target:
                    return 0
                steps = min(steps, r.output - r.generated - 1)  # the finishing step is taken singly
                ctx += r.prompt + r.generated
            head = self._waiting[0] if self._waiting else None
            if head is not None and self._admission_hit(head, budget_used=batch) is not None:
                return 0
            k = int(steps)
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
            span = self._span = _Span(self._clock, first_ms, p.f_ms_per_ctx_token * batch, 0, k, head)
        elif self._waiting and self._waiting[0] is not span.head:  # a new arrival heads the queue
            if self._admission_hit(self._waiting[0], budget_used=len(running)) is not None:
                return 0
            span.head = self._waiting[0]
        clock0, first_ms, growth_ms, done = span.clock0, span.first_ms, span.growth_ms, span.done
        k = span.limit - done
        if k <= 0:
            return 0
        within = (
            _steps_within(first_ms, growth_ms, (until_s - clock0) * 1000.0) - done
            if until_s < math.inf
            else k
        )
        straddles = within <= 0  # the next step ends after until_s: commit it as a pending step of this span
        k = 1 if straddles else min(k, within)
        bs = self._bs
        grown = 0
        for r in running:
            g = r.generated
            need = -(-(g + k) // bs) + (g // -bs)  # ceil((g+k)/bs) - ceil(g/bs) new decode blocks
            r.private += need
            grown += need
            if not straddles:
                r.generated = g + k
        self._private_total += grown
        self._cache.take(grown)
        total = span.done = done + k
        clock = clock0 + (total * first_ms + growth_ms * total * (total - 1) / 2) / 1000.0
        if straddles:
            self._pending = _Step(clock, clock - self._clock, list(running), [])
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

    def _grow(self, r: _Req) -> bool:
        """Give decoding `r` one more engine block, preempting the newest running requests if the pool is
        exhausted; False when `r` itself had to be preempted."""
        while self._cache.free + self._cache.evictable < 1:
            victim = self._running[-1]
            if victim is r:
                if len(self._running) == 1:
                    break  # a lone request: over-commit rather than deadlock
                self._preempt(r)
                return False
            self._preempt(victim)
        self._cache.take(1)
        r.private += 1
        self._private_total += 1
        return True

    def _admission_hit(self, r: _Req, budget_used: int = 0) -> int | None:
        """Leading cached blocks `r` would hit if admitted now, or None if it does not fit (KV, slots)."""
        if (
            budget_used >= self.profile.max_num_batched_tokens
            or len(self._running) >= self.profile.max_num_seqs
        ):
            return None
        size, ref = self._cache.size, self._cache.ref
        hit = 0
        for key in r.keys:
            if key not in size:
                break
            hit += 1
        if hit == len(r.keys) and r.generated == 0:
            hit -= 1  # vLLM always computes the last prompt token, so the last block is recomputed
        if not self._running:
            return hit  # an idle engine runs its head request whatever it costs
        need = sum(r.sizes[hit:]) + -(-(r.generated + 1) // self._bs)
        pinned_hits = sum(r.sizes[i] for i in range(hit) if ref[r.keys[i]] == 0)
        return hit if need <= self._cache.free + self._cache.evictable - pinned_hits else None

    def _admit(self, r: _Req, hit: int) -> None:
        cache = self._cache
        for i in range(hit):
            cache.pin(r.keys[i])
        r.held = hit
        r.computed = r.cum[hit - 1] if hit else 0
        r.target = r.prompt + r.generated
        if r.cached_tokens < 0:
            r.cached_tokens = r.computed
        r.private = sum(r.sizes[hit:]) + -(-(r.generated + 1) // self._bs)
        self._private_total += r.private
        cache.take(r.private)
        r.state = _RUNNING
        self._running.append(r)
        self.prefix_cache_queries += r.prompt
        self.prefix_cache_hits += r.computed

    def _cache_computed_blocks(self, r: _Req) -> None:
        cache, cum, computed = self._cache, r.cum, r.computed
        held = start = r.held
        while held < len(cum) and cum[held] <= computed:
            key, size = r.keys[held], r.sizes[held]
            if key in cache.size:
                cache.pin(key)  # computed twice concurrently: share the cached copy, free ours
                cache.free += size
            else:
                cache.insert_pinned(key, size)
            held += 1
        if held > start:
            moved = sum(r.sizes[start:held])
            r.private -= moved
            self._private_total -= moved
            r.held = held

    def _release(self, r: _Req) -> None:
        cache = self._cache
        unpin = cache.unpin
        for key in r.keys[r.held - 1 :: -1] if r.held else ():  # tail first: deeper blocks go first on ties
            unpin(key)
        cache.free += r.private
        self._private_total -= r.private
        r.private = r.held = 0

    def _preempt(self, r: _Req) -> None:
        self._release(r)
        r.computed = r.target = 0
        r.state = _WAITING
        self._running.remove(r)
        self._waiting.appendleft(r)
        self.num_preemptions += 1

    def _finish(self, r: _Req, at_s: float, events: list[EngineEvent]) -> None:
        self._release(r)
        r.state = _ENDED
        self._live.pop(r.id, None)
        self._done[r.id] = r.generated
        if len(self._done) > _DONE_MEMORY:
            self._done.popitem(last=False)
        events.append(Finished(r.id, at_s, r.generated))

    def _clone(self) -> Engine:
        """An independent copy for look-ahead (no KV events, no memory of finished requests)."""
        twin = Engine.__new__(Engine)
        twin.__dict__.update(self.__dict__)
        twin._cache = self._cache.overlay()
        copies = {id(r): r.copy() for r in self._live.values()}
        twin._live = {r.id: copies[id(r)] for r in self._live.values()}
        twin._running = [copies[id(r)] for r in self._running]
        twin._waiting = deque(copies[id(r)] for r in self._waiting)
        twin._done = OrderedDict()
        twin._buffer = []
        if self._span is not None:
            head = self._span.head
            twin._span = replace(self._span, head=copies.get(id(head)) if head is not None else None)
        if self._pending is not None:
            s = self._pending
            twin._pending = _Step(
                s.end_s,
                s.duration_s,
                [copies[id(r)] for r in s.decodes if id(r) in copies],
                [(copies[id(r)], n) for r, n in s.prefills if id(r) in copies],
            )
        return twin


def _steps_within(first_ms: float, growth_ms: float, window_ms: float) -> int:
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
