"""`PrefixIndex`: which worker holds which prefix blocks, as a pure bounded data structure.

The gateway mirrors the Redis prefix index into one of these; the simulator uses it directly. Per
worker a bounded LRU of block hashes (capacity in blocks, settable per worker, e.g. from the worker's
KV capacity), plus the reverse map hash → workers that `match` walks.

  match(hashes)   leading blocks each worker holds: consecutive from block 0, a worker stops at its first
                  miss, the walk stops as soon as no worker holds block i (cost O(matched blocks × holders)).
  insert(w, hs)   touch tail-first, so the root blocks of a chain are the most recently used and a chain
                  is evicted from its tail (vLLM evicts the deeper block first on ties, ENGINE.md §3).
  forget_before(w, t)  drop w's entries last touched before t (hit feedback: policy/feedback.py says
                  which t the engine's reported cached tokens prove stale; `touched_s` reads the times).

Memory: at most Σ capacity(w) entries (each held once per worker in the LRU and once in the reverse map),
plus for an exact worker up to as many speculative entries again: they do not evict the blocks its
engine reported stored, since the engine frees room for them itself and says which (BlockRemoved).

Hybrid (exact mode, docs/EXACT.md): each worker has a kind. An `exact` worker's entries come from its
engine's KV events (`insert`); what routing sends it is `insert_routed` as a *speculative* entry that
lives `speculative_ttl_s` unless its BlockStored confirms it first (an exact `insert` of the same hash),
covering the gap between the routing decision and the engine's event. An `approximate` worker (one that
publishes no events) gets routing history: `insert_routed` is a plain entry. `match_kind` says which kind
a worker's match rests on: `exact`, `speculative` (some matched block is unconfirmed) or `approximate`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

_NOBODY: frozenset[str] = frozenset()
KINDS = ("exact", "approximate")
DEFAULT_SPECULATIVE_TTL_S = 3.0  # Dynamo, llm-d and vllm-router keep theirs 2-5 s


class PrefixIndex:
    """Approximate (routing-history) or exact (KV-event) prefix → worker index with per-worker LRUs."""

    def __init__(
        self, default_capacity_blocks: int, *, speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    ) -> None:
        if default_capacity_blocks <= 0:
            raise ValueError(f"default_capacity_blocks must be > 0, not {default_capacity_blocks}")
        if speculative_ttl_s <= 0:
            raise ValueError(f"speculative_ttl_s must be > 0, not {speculative_ttl_s}")
        self.default_capacity_blocks = default_capacity_blocks
        self.speculative_ttl_s = speculative_ttl_s
        self._capacity: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[int, float]] = {}  # worker -> hash -> last touched (s), LRU order
        self._holders: dict[int, set[str]] = {}
        self._kind: dict[str, str] = {}  # worker -> "exact" (publishes KV events); absent = approximate
        self._speculative: dict[str, dict[int, float]] = {}  # exact worker -> unconfirmed hash -> expiry
        self._expiries: deque[tuple[float, str, int]] = deque()  # in expiry order (one TTL for all)

    # -- configuration -------------------------------------------------------------------------------
    def set_capacity(self, worker: str, blocks: int) -> None:
        """Bound `worker`'s entries to `blocks`, evicting its least recently used entries if needed."""
        if blocks <= 0:
            raise ValueError(f"capacity of {worker!r} must be > 0 blocks, not {blocks}")
        self._capacity[worker] = blocks
        self._evict(worker)

    def capacity(self, worker: str) -> int:
        return self._capacity.get(worker, self.default_capacity_blocks)

    def set_kind(self, worker: str, kind: str) -> None:
        """`exact`: `worker`'s engine publishes KV events; `approximate` (the default): it does not."""
        if kind not in KINDS:
            raise ValueError(f"index kind must be one of {KINDS}, not {kind!r}")
        if kind == "exact":
            self._kind[worker] = kind
        elif self._kind.pop(worker, None) is not None:
            self._speculative.pop(worker, None)  # its unconfirmed entries become plain history

    def kind(self, worker: str) -> str:
        return self._kind.get(worker, "approximate")

    # -- queries -------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """worker -> number of leading blocks of `hashes` it holds (workers holding none are absent)."""
        result: dict[str, int] = {}
        alive: set[str] | None = None
        matched = 0  # leading blocks every worker in `alive` holds
        for h in hashes:
            holders = self._holders.get(h)
            if not holders:
                break
            if alive is None:
                alive = set(holders)
                result = dict.fromkeys(alive, 1)  # the workers in the order the walk met them
            elif not alive <= holders:  # a block shared by all (the common case) allocates nothing
                for w in alive - holders:
                    result[w] = matched
                alive &= holders
                if not alive:
                    return result
            matched += 1
        for w in alive or ():
            result[w] = matched
        return result

    def match_kind(self, worker: str, hashes: Sequence[int], blocks: int) -> str:
        """Which kind `worker`'s match of the first `blocks` of `hashes` rests on ("none" if no block)."""
        if blocks <= 0:
            return "none"
        if worker not in self._kind:
            return "approximate"
        unconfirmed = self._speculative.get(worker)
        if unconfirmed and not unconfirmed.keys().isdisjoint(hashes[:blocks]):
            return "speculative"
        return "exact"

    def touched_s(self, worker: str, hashes: Sequence[int]) -> list[float]:
        """When each leading block of `hashes` was last touched on `worker`, up to its first absent one."""
        lru = self._lru.get(worker)
        out: list[float] = []
        if lru:
            for h in hashes:
                at = lru.get(h)
                if at is None:
                    break
                out.append(at)
        return out

    def speculative_size(self, worker: str) -> int:
        return len(self._speculative.get(worker, ()))

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
        """Record that `worker` holds every block of `hashes` (as of `now_s`): confirmed, for an exact one."""
        unconfirmed = self._speculative.get(worker)
        if unconfirmed:
            for h in hashes:
                unconfirmed.pop(h, None)
        self._touch(worker, hashes, now_s)

    def insert_routed(self, worker: str, hashes: Sequence[int], now_s: float) -> None:
        """`hashes` were just routed to `worker`: history for an approximate worker; for an exact one,
        speculative entries for the blocks it does not hold yet, gone after `speculative_ttl_s` unless
        its KV events confirm them (blocks it holds are only touched)."""
        if worker not in self._kind:
            self._touch(worker, hashes, now_s)
            return
        lru = self._lru.get(worker)
        unconfirmed = self._speculative.setdefault(worker, {})
        expiry = now_s + self.speculative_ttl_s
        for h in hashes:
            if lru is None or h not in lru or h in unconfirmed:
                unconfirmed[h] = expiry
                self._expiries.append((expiry, worker, h))
        self._touch(worker, hashes, now_s)

    def expire(self, now_s: float) -> int:
        """Drop the speculative entries whose TTL ran out by `now_s`; returns how many."""
        dropped = 0
        expiries = self._expiries
        while expiries and expiries[0][0] <= now_s:
            expiry, worker, h = expiries.popleft()
            unconfirmed = self._speculative.get(worker)
            if unconfirmed is not None and unconfirmed.get(h) == expiry:  # not confirmed nor re-routed since
                del unconfirmed[h]
                self._forget(worker, h)
                dropped += 1
        return dropped

    def _touch(self, worker: str, hashes: Sequence[int], now_s: float) -> None:
        lru = self._lru.get(worker)
        if lru is None:
            lru = self._lru[worker] = OrderedDict()
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                lru[h] = now_s  # last touch: hit feedback drops the entries older than a missed block
            else:
                self._holders.setdefault(h, set()).add(worker)
                lru[h] = now_s
        self._evict(worker)

    def remove(self, worker: str, hashes: Iterable[int]) -> None:
        """Forget blocks `worker` no longer holds (a KV `BlockRemoved` event)."""
        lru = self._lru.get(worker)
        if not lru:
            return
        unconfirmed = self._speculative.get(worker)
        for h in hashes:
            if h in lru:
                del lru[h]
                self._drop_holder(h, worker)
                if unconfirmed:
                    unconfirmed.pop(h, None)

    def forget_before(self, worker: str, before_s: float) -> list[int]:
        """Forget `worker`'s entries last touched before `before_s` (hit feedback, policy/feedback.py):
        the LRU's oldest first, so this costs the entries dropped. Returns their hashes."""
        lru = self._lru.get(worker)
        dropped: list[int] = []
        if not lru:
            return dropped
        unconfirmed = self._speculative.get(worker)
        while lru:
            h, at = next(iter(lru.items()))
            if at >= before_s:
                break
            del lru[h]
            self._drop_holder(h, worker)
            if unconfirmed:
                unconfirmed.pop(h, None)
            dropped.append(h)
        return dropped

    def clear(self, worker: str) -> None:
        """Forget everything `worker` held (it left, restarted or reported `AllBlocksCleared`)."""
        self._speculative.pop(worker, None)
        for h in self._lru.pop(worker, OrderedDict()):
            self._drop_holder(h, worker)

    def _forget(self, worker: str, h: int) -> None:
        lru = self._lru.get(worker)
        if lru is not None and lru.pop(h, None) is not None:
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
        capacity = self.capacity(worker)
        unconfirmed = self._speculative.get(worker)
        # An exact worker's speculative entries (up to its capacity again) come on top: the engine makes
        # room for them itself and reports it (BlockRemoved), where this LRU's order would evict other
        # blocks than the engine's, entries that would not come back while the engine keeps the blocks.
        while len(lru) > capacity + (min(len(unconfirmed), capacity) if unconfirmed else 0):
            h, _ = lru.popitem(last=False)
            self._drop_holder(h, worker)
            if unconfirmed:
                unconfirmed.pop(h, None)
