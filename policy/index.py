"""`PrefixIndex`: which worker holds which prefix blocks, as a pure bounded data structure.

The gateway mirrors the Redis prefix index into one of these; the simulator uses it directly. Per
worker a bounded LRU of block hashes (capacity in blocks, settable per worker, e.g. from the worker's
KV capacity), plus the reverse map hash → workers that `match` walks.

  match(hashes)   leading blocks each worker holds: consecutive from block 0, a worker stops at its first
                  miss, the walk stops as soon as no worker holds block i (cost O(matched blocks × holders)).
  insert(w, hs)   touch tail-first, so the root blocks of a chain are the most recently used and a chain
                  is evicted from its tail (vLLM evicts the deeper block first on ties, ENGINE.md §3).

Memory: at most Σ capacity(w) entries (each held once per worker in the LRU and once in the reverse map).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

_NOBODY: frozenset[str] = frozenset()


class PrefixIndex:
    """Approximate (routing-history) or exact (KV-event) prefix → worker index with per-worker LRUs."""

    def __init__(self, default_capacity_blocks: int) -> None:
        if default_capacity_blocks <= 0:
            raise ValueError(f"default_capacity_blocks must be > 0, not {default_capacity_blocks}")
        self.default_capacity_blocks = default_capacity_blocks
        self._capacity: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[int, float]] = {}  # worker -> hash -> last touched (s)
        self._holders: dict[int, set[str]] = {}

    # -- configuration -------------------------------------------------------------------------------
    def set_capacity(self, worker: str, blocks: int) -> None:
        """Bound `worker`'s entries to `blocks`, evicting its least recently used entries if needed."""
        if blocks <= 0:
            raise ValueError(f"capacity of {worker!r} must be > 0 blocks, not {blocks}")
        self._capacity[worker] = blocks
        self._evict(worker)

    def capacity(self, worker: str) -> int:
        return self._capacity.get(worker, self.default_capacity_blocks)

    # -- queries -------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """worker -> number of leading blocks of `hashes` it holds (workers holding none are absent)."""
        result: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for w in alive:
                result[w] = i + 1
        return result

    def holders(self, block_hash: int) -> frozenset[str]:
        return frozenset(self._holders.get(block_hash, _NOBODY))

    def size(self, worker: str) -> int:
        lru = self._lru.get(worker)
        return len(lru) if lru else 0

    def workers(self) -> list[str]:
        return [w for w, lru in self._lru.items() if lru]

    def total_entries(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    # -- updates -------------------------------------------------------------------------------------
    def insert(self, worker: str, hashes: Sequence[int], now_s: float) -> None:
        """Record that `worker` holds every block of `hashes` (as of `now_s`)."""
        lru = self._lru.get(worker)
        if lru is None:
            lru = self._lru[worker] = OrderedDict()
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                self._holders.setdefault(h, set()).add(worker)
            lru[h] = now_s
        self._evict(worker)

    def remove(self, worker: str, hashes: Iterable[int]) -> None:
        """Forget blocks `worker` no longer holds (a KV `BlockRemoved` event)."""
        lru = self._lru.get(worker)
        if not lru:
            return
        for h in hashes:
            if h in lru:
                del lru[h]
                self._drop_holder(h, worker)

    def clear(self, worker: str) -> None:
        """Forget everything `worker` held (it left, restarted or reported `AllBlocksCleared`)."""
        for h in self._lru.pop(worker, OrderedDict()):
            self._drop_holder(h, worker)

    def _drop_holder(self, h: int, worker: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]

    def _evict(self, worker: str) -> None:
        lru = self._lru.get(worker)
        if lru is None:
            return
        limit = self.capacity(worker)
        while len(lru) > limit:
            h, _ = lru.popitem(last=False)
            self._drop_holder(h, worker)
