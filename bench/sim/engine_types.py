"""Requests, events and scheduling records of the engine model (bench/sim/engine.py).

`EngineRequest` goes in, `FirstToken` / `Finished` come out (import them from bench/sim/engine.py, which
re-exports them). `ReqState` is one request's mutable scheduling state inside the engine, `Step` a step
planned at its start and applied at its end, `Span` a run of pure-decode steps applied in closed form
(bench/sim/engine_span.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from itertools import accumulate

RequestId = str | int

WAITING, RUNNING, ENDED = 0, 1, 2  # ReqState.state
DONE_MEMORY = 100_000  # finished ids remembered for progress()


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


class ReqState:
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
        self.state = WAITING

    def copy(self) -> ReqState:
        twin = ReqState.__new__(ReqState)
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
class Span:
    """A run of pure-decode steps of an unchanged batch: step i (from 0) of it lasts first + growth·i ms."""

    clock0: float  # when its first step started
    first_ms: float
    growth_ms: float  # f·B: Σctx grows by one token per sequence per step
    done: int  # steps taken (applied, or committed as the pending step)
    limit: int  # steps it may take before a request finishes or the KV pool runs short
    head: ReqState | None  # head of the waiting queue, known not to be admissible during the span


@dataclass(slots=True)
class Step:
    end_s: float
    duration_s: float
    decodes: list[ReqState]
    prefills: list[tuple[ReqState, int]]
