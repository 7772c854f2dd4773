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
from dataclasses import replace

from bench.sim.engine_span import DecodeSpans
from bench.sim.engine_types import (
    ENDED,
    RUNNING,
    EngineEvent,
    EngineRequest,
    Finished,
    FirstToken,
    ReqState,
    RequestId,
    Step,
)
from bench.sim.profiles import step_time_ms

__all__ = ["Engine", "EngineEvent", "EngineRequest", "Finished", "FirstToken", "RequestId"]


class Engine(DecodeSpans):
    """One simulated worker; see the module docstring for the model and the driving contract.

    Engine(profile, *, record_kv_events=False, reference=False): state and request bookkeeping in
    bench/sim/engine_state.py, closed-form decode spans in bench/sim/engine_span.py."""

    # ---- driving -------------------------------------------------------------------------------------

    def submit(self, req: EngineRequest, now_s: float) -> None:
        """The request arrives in the waiting queue at `now_s` (>= the last `advance` time)."""
        if req.id in self._live:
            raise ValueError(f"request {req.id!r} is already in the engine")
        r = ReqState(req, self._bs) if req.blocks else None
        if r is None or req.output_tokens < 1 or min(r.sizes) < 1:  # a block of < 1 token: < 1 engine block
            raise ValueError(
                f"request {req.id!r} needs >= 1 prompt block of >= 1 token and output_tokens >= 1"
            )
        self._catch_up(now_s)
        self._live[r.id] = r
        self._waiting.append(r)
        if self._pending is None and len(self._waiting) == 1 and not self._running:
            self._clock = max(self._clock, now_s)  # idle engine: time jumps to the arrival
        self._next_event_memo = None

    def restart(self, now_s: float) -> None:
        """The worker restarts at `now_s`: every running request loses its KV and starts over (a
        recompute preemption, as a client's retry would), and the whole prefix cache is gone ("cleared"
        for every block). `clear_cache` alone (reset_prefix_cache) keeps the blocks running requests pin."""
        self._catch_up(now_s)
        for r in reversed(list(self._running)):  # _preempt puts each at the queue's head: oldest ends first
            self._preempt(r)
        self._span = None
        self.clear_cache()

    def abort(self, req_id: RequestId, now_s: float) -> None:
        """The client went away: drop the request and free its blocks; no event. Unknown ids are ignored."""
        self._catch_up(now_s)
        r = self._live.pop(req_id, None)
        if r is None:
            return
        if r.state == RUNNING:
            self._release(r)
            self._running.remove(r)
            self._span = None
        else:
            self._waiting.remove(r)
        r.state = ENDED
        self._next_event_memo = None

    def advance(self, until_s: float) -> list[EngineEvent]:
        """Run the engine up to `until_s`; returns the events that happened by then, in time order."""
        self._catch_up(until_s)
        if not self._buffer:
            return []
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

    def _catch_up(self, until_s: float) -> None:
        memo = self._next_event_memo
        if memo is not None and memo[0] is not None and memo[0] <= until_s:
            self._next_event_memo = None  # spans may round differently from the look-ahead; recompute
        events = self._run(until_s)
        if events:
            self._buffer.extend(events)
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

    def _plan(self, start_s: float) -> Step:
        """Choose the next step's work at its start: decodes, prefill chunks, admissions (vLLM V1 order)."""
        self._span = None
        p = self.profile
        running, bs = self._running, self._bs
        decodes: list[ReqState] = []
        prefilling: list[ReqState] = []
        decode_ctx = 0
        preemptions = self.num_preemptions
        i, n = 0, len(running)
        while i < n:  # _grow preempts from the end, never a request already looked at
            r = running[i]
            i += 1
            if r.computed < r.target:
                prefilling.append(r)
                continue
            if r.generated % bs == 0:  # a new engine block for its next token
                grown = self._grow(r)
                n = len(running)
                if not grown:
                    continue
            decodes.append(r)
            decode_ctx += r.prompt + r.generated
        budget = p.max_num_batched_tokens - len(decodes)
        prefills: list[tuple[ReqState, int]] = []
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
        return Step(start_s + duration_s, duration_s, decodes, prefills)

    def _apply(self, step: Step, events: list[EngineEvent]) -> None:
        """The step ends: tokens appear, computed blocks become cached, finished requests leave."""
        at_s = step.end_s
        ended = False
        for r in step.decodes:
            if r.state == RUNNING:
                r.generated += 1
                if r.generated >= r.output:
                    self._finish(r, at_s, events)
                    ended = True
        for r, n in step.prefills:
            if r.state != RUNNING:
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
            self._running = [r for r in self._running if r.state == RUNNING]

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
            twin._pending = Step(
                s.end_s,
                s.duration_s,
                [copies[id(r)] for r in s.decodes if id(r) in copies],
                [(copies[id(r)], n) for r, n in s.prefills if id(r) in copies],
            )
        return twin
