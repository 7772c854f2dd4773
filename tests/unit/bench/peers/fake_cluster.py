"""A hand-made `ClusterView` for peer-router unit tests: every signal is a plain dict the test sets.

This stands in for the simulator's cluster interface (not a kvgate component), so tests can pin a
peer's decision rule on exact loads, scrapes and cache contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.sim.types import Scraped, SimRequest
from policy.types import WorkerView


@dataclass
class FakeCluster:
    workers: list[str]
    inflight_by: dict[str, int] = field(default_factory=dict)
    pending_by: dict[str, int] = field(default_factory=dict)
    scraped_by: dict[str, Scraped] = field(default_factory=dict)
    # worker -> set of block ids its engine holds; cached_prefix_blocks = leading run held
    engine_blocks: dict[str, set[int]] = field(default_factory=dict)
    capacity: int = 436_551
    concurrency: int = 256

    @property
    def worker_ids(self) -> Sequence[str]:
        return self.workers

    def inflight(self, worker_id: str) -> int:
        return self.inflight_by.get(worker_id, 0)

    def pending_prefill_tokens(self, worker_id: str) -> int:
        return self.pending_by.get(worker_id, 0)

    def scraped(self, worker_id: str) -> Scraped:
        return self.scraped_by.get(worker_id, Scraped(at_s=0.0, running=0, waiting=0, kv_usage=0.0))

    def cached_prefix_blocks(self, worker_id: str, req: SimRequest) -> int:
        held = self.engine_blocks.get(worker_id, set())
        n = 0
        for bid in req.block_ids:
            if bid not in held:
                break
            n += 1
        return n

    def capacity_tokens(self, worker_id: str) -> int:
        return self.capacity

    def max_concurrency(self, worker_id: str) -> int:
        return self.concurrency

    def worker_views(self, now_s: float) -> list[WorkerView]:
        views = []
        for w in self.workers:
            s = self.scraped(w)
            views.append(
                WorkerView(
                    id=w,
                    inflight=self.inflight(w),
                    running=s.running,
                    waiting=s.waiting,
                    kv_usage=s.kv_usage,
                    pending_prefill_tokens=self.pending_prefill_tokens(w),
                    capacity_tokens=self.capacity,
                    max_concurrency=self.concurrency,
                )
            )
        return views


def request(block_ids: Sequence[int], rid: int = 0, last_tokens: int = 512, output: int = 10) -> SimRequest:
    """A request whose blocks are 512 tokens each except the last (`last_tokens`)."""
    tokens = tuple([512] * (len(block_ids) - 1) + [last_tokens]) if block_ids else ()
    return SimRequest(
        id=rid,
        arrival_s=0.0,
        input_tokens=sum(tokens),
        output_tokens=output,
        block_ids=tuple(block_ids),
        block_tokens=tokens,
    )
