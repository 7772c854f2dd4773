"""Runs the simulator's engine model in real time and wakes the HTTP streams of its requests.

Virtual time is `(monotonic() - t_start) / time_scale`: with `time_scale` 0.1 the emulated GPU runs
10× faster than the one the profile models. One background task per server advances the engine to
"now", hands first tokens and completions to the waiting requests, and sleeps until the engine's
next event, or, while requests are decoding, at most `stream_interval_s` (wall) so their tokens
flow out in small batches; never less than `min_sleep_s`, so a fast time scale cannot spin the CPU.
Requests wait on one `asyncio.Event` each; nothing polls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from bench.emulator.kv_events import EngineKvEvent
from bench.sim.engine import Engine, EngineRequest, Finished, FirstToken, RequestId

logger = logging.getLogger(__name__)
KvSink = Callable[[list[EngineKvEvent]], Awaitable[None]]


class EngineBroken(RuntimeError):
    """The engine model raised; the emulated worker answers 500 from then on."""


@dataclass(eq=False)
class RequestState:
    """One request inside the engine, as its HTTP handler follows it."""

    engine_id: int
    external_id: str
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None = None  # virtual time of the first token
    cached_tokens: int = 0
    finished: bool = False
    failed: bool = False  # the engine broke; the request ends with an error
    generated: int = 0  # tokens generated as of the driver's last look (or the handler's own)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def started(self) -> bool:
        return self.first_token_s is not None


class EngineDriver:
    """The engine plus its real-time clock; `run()` is the background task."""

    def __init__(
        self,
        engine: Engine,
        time_scale: float,
        *,
        stream_interval_s: float = 0.02,
        min_sleep_s: float = 0.001,
        kv_sink: KvSink | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.engine = engine
        self.time_scale = time_scale
        self.stream_interval_s = stream_interval_s
        self.min_sleep_s = min_sleep_s
        self._kv_sink = kv_sink
        self._t0 = time.monotonic()
        self._ids = itertools.count(1)
        self._states: dict[RequestId, RequestState] = {}  # engine id -> state, while in the engine
        self._kicked = asyncio.Event()
        self._advanced_to = 0.0
        self._kv_events: list[EngineKvEvent] = []  # drained from the engine, not yet handed to the sink
        self.broken: BaseException | None = None  # set when the engine raised; no request is accepted after

    # --- used by the HTTP handlers ---

    def virtual_now(self) -> float:
        # never behind the last advance: the engine wants non-decreasing times
        return max(self._advanced_to, (time.monotonic() - self._t0) / self.time_scale)

    def submit(self, external_id: str, blocks: Sequence[tuple[int, int]], output_tokens: int) -> RequestState:
        """Queue a request whose prompt is `blocks` ((key, tokens) each) in the engine."""
        if self.broken is not None:
            raise EngineBroken(f"the engine model failed: {self.broken!r}")
        now = self.virtual_now()
        self._advance(now)
        state = RequestState(next(self._ids), external_id, sum(t for _, t in blocks), output_tokens)
        self._states[state.engine_id] = state
        self.engine.submit(EngineRequest(state.engine_id, tuple(blocks), output_tokens), now)
        self._kicked.set()
        return state

    def abort(self, state: RequestState) -> None:
        """Drop a request the client gave up on; no-op once it has finished."""
        if state.finished or self._states.pop(state.engine_id, None) is None:
            return
        now = self.virtual_now()
        self._advance(now)
        if not state.finished:
            self.engine.abort(state.engine_id, now)
        state.finished = True
        self._kicked.set()

    def refresh(self, state: RequestState) -> int:
        """Tokens generated so far (also stored in `state.generated`)."""
        if state.failed:
            return state.generated
        if state.finished:
            state.generated = state.output_tokens
        elif state.started:
            progress = self.engine.progress(state.engine_id, self.virtual_now())
            state.generated = max(state.generated, min(progress, state.output_tokens))
        return state.generated

    def clear_cache(self) -> None:
        """vLLM's reset_prefix_cache: drop every cached block no running request uses. Always reports
        "cleared" (AllBlocksCleared), also when the cache was already empty, as vLLM does."""
        self._advance(self.virtual_now())
        self._kv_events += self.engine.drain_kv_events()
        self.engine.clear_cache()
        events = self.engine.drain_kv_events()
        if self._kv_sink is not None and not any(kind == "cleared" for kind, _ in events):
            events.append(("cleared", []))
        self._kv_events += events
        self._kicked.set()

    @property
    def inflight_ids(self) -> list[str]:
        return [s.external_id for s in self._states.values()]

    # --- the background task ---

    async def run(self) -> None:
        try:
            await self._loop()
        except Exception as e:
            # a bug in the engine model must not leave every client hanging: fail them all, loudly
            logger.exception("engine driver failed; failing %d requests", len(self._states))
            self.broken = e
            for state in self._states.values():
                state.failed = state.finished = True
                state.wake.set()
            self._states.clear()
            raise

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._kicked.clear()
            now = self.virtual_now()
            self._advance(now)
            decoding = self._wake_decoding()
            if self._kv_sink is not None:
                events, self._kv_events = [*self._kv_events, *self.engine.drain_kv_events()], []
                if events:
                    await self._kv_sink(events)
            delay = self._next_delay(now, decoding)
            timer = None if delay is None else loop.call_later(delay, self._kicked.set)
            try:
                await self._kicked.wait()
            finally:
                if timer is not None:
                    timer.cancel()

    def _advance(self, now: float) -> None:
        if now < self._advanced_to:
            return
        self._advanced_to = now
        for result in self.engine.advance(now):
            state = self._states.get(result.id)
            if state is None:
                continue
            if isinstance(result, FirstToken):
                state.first_token_s = result.at_s
                state.cached_tokens = result.cached_tokens
            elif isinstance(result, Finished):
                if state.first_token_s is None:  # first and last token in one step
                    state.first_token_s = result.at_s
                state.finished = True
                state.generated = state.output_tokens
                del self._states[result.id]
            state.wake.set()

    def _wake_decoding(self) -> bool:
        """Wake every decoding request that has new tokens; True if any request is decoding."""
        decoding = False
        for state in self._states.values():
            if state.started:
                decoding = True
                before = state.generated
                if self.refresh(state) > before:
                    state.wake.set()
        return decoding

    def _next_delay(self, now: float, decoding: bool) -> float | None:
        delays = []
        next_event = self.engine.next_event_s()
        if next_event is not None:
            delays.append((next_event - now) * self.time_scale)
        if decoding:
            delays.append(self.stream_interval_s)
        return max(min(delays), self.min_sleep_s) if delays else None
