"""Shared helpers for the peer routers: registry-order argmin, a deterministic 64-bit hash, and the
mapping of trace blocks onto each peer's own granularity (shared/reference/PEERS.md §5).

Trace blocks follow Mooncake semantics: `block_ids[i]` names the whole prefix 0..i and
`block_tokens[i]` is its token count (512 except a shorter last block). Peers that work on
characters assume 4 chars per token; peers that work on smaller token blocks see `ntok // b`
full sub-blocks per trace block (engines and Dynamo cache only full blocks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from bench.sim.types import SimRequest

T = TypeVar("T")


def first_argmin(items: Iterable[T], key: Callable[[T], float]) -> T:
    """The first item with the smallest key: ties go to registry order (SGLang, CHWBL fallbacks)."""
    best: T | None = None
    best_key = 0.0
    for item in items:
        k = key(item)
        if best is None or k < best_key:
            best, best_key = item, k
    if best is None:
        raise ValueError("first_argmin of an empty sequence")
    return best


def hash64(text: str) -> int:
    """A 64-bit hash stable across processes and Python versions (unlike `hash()`)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def cumulative_tokens(req: SimRequest) -> list[int]:
    """`out[k]` = prompt tokens covered by the first k trace blocks (out[0] = 0)."""
    out = [0]
    total = 0
    for n in req.block_tokens:
        total += n
        out.append(total)
    return out


def full_sub_blocks(tokens: int, block_size: int) -> int:
    """Full engine blocks of `block_size` tokens within `tokens` (partial blocks are never cached)."""
    return tokens // block_size


def leading_cached_tokens(req: SimRequest, cached_blocks: int, cum: Sequence[int] | None = None) -> int:
    """Prompt tokens covered by the first `cached_blocks` trace blocks."""
    k = min(cached_blocks, len(req.block_tokens))
    if cum is not None:
        return cum[k]
    return sum(req.block_tokens[:k])


class TenantBlockTree:
    """SGLang's approximate union radix tree, at trace-block granularity and weighted in chars.

    Because a Mooncake block id names its whole prefix, the tree's path to block i is implied by the
    id, so the tree is stored flat: block id -> owners. Each tenant's set stays prefix-closed
    (leaves are evicted before their parents), hence so does the union, and `match` walks from the
    root while blocks are present. `last_tenant` of a block = the tenant that first inserted it (its
    creator; SGLang copies it on split, so it stays the creator).
    """

    def __init__(self) -> None:
        self._owners: dict[int, dict[str, None]] = {}  # block -> tenants holding it, insertion order
        self._creator: dict[int, str] = {}
        self._chars: dict[int, int] = {}
        self._lru: dict[str, dict[int, None]] = {}  # tenant -> its blocks, least recent first
        self._tenant_chars: dict[str, int] = {}

    def add_tenant(self, tenant: str) -> None:
        """Register a tenant with an empty tree (SGLang inserts "" for every worker at start)."""
        if tenant not in self._lru:
            self._lru[tenant] = {}
            self._tenant_chars[tenant] = 0

    def tenant_chars(self, tenant: str) -> int:
        return self._tenant_chars.get(tenant, 0)

    def match(self, block_ids: Sequence[int]) -> tuple[str | None, int]:
        """(last_tenant of the deepest matched block or another holder, matched chars) on the union tree."""
        matched = 0
        last: int | None = None
        for bid in block_ids:
            if bid not in self._owners:
                break
            matched += self._chars[bid]
            last = bid
        if last is None:
            return None, 0
        owners = self._owners[last]
        creator = self._creator[last]
        return (creator if creator in owners else next(iter(owners))), matched

    def match_tenant(self, block_ids: Sequence[int], tenant: str) -> int:
        """Chars of the leading blocks `tenant` holds (vllm-router's per-worker match: it stops at the
        first node the tenant does not own)."""
        matched = 0
        for bid in block_ids:
            owners = self._owners.get(bid)
            if owners is None or tenant not in owners:
                break
            matched += self._chars[bid]
        return matched

    def insert(self, block_ids: Sequence[int], block_chars: Sequence[int], tenant: str) -> None:
        """Add `tenant` along the path; every node on it becomes fresh for the tenant, the root freshest."""
        self.add_tenant(tenant)
        lru = self._lru[tenant]
        added = 0
        for i in range(len(block_ids) - 1, -1, -1):  # leaf first, so parents end up more recent
            bid = block_ids[i]
            owners = self._owners.get(bid)
            if owners is None:
                owners = self._owners[bid] = {}
                self._creator[bid] = tenant
                self._chars[bid] = block_chars[i]
            if tenant in owners:
                del lru[bid]
            else:
                owners[tenant] = None
                added += self._chars[bid]
            lru[bid] = None
        self._tenant_chars[tenant] += added

    def _drop(self, tenant: str, bid: int) -> None:
        owners = self._owners[bid]
        del owners[tenant]
        self._tenant_chars[tenant] -= self._chars[bid]
        if not owners:
            del self._owners[bid], self._creator[bid], self._chars[bid]

    def evict(self, max_chars: int) -> None:
        """Tenants above `max_chars` lose their least recently used leaves until under the limit."""
        for tenant, lru in self._lru.items():
            while self._tenant_chars[tenant] > max_chars and lru:
                bid = next(iter(lru))
                del lru[bid]
                self._drop(tenant, bid)

    def remove_tenant(self, tenant: str) -> None:
        for bid in self._lru.pop(tenant, {}):
            self._drop(tenant, bid)
        self._tenant_chars.pop(tenant, None)

    def smallest_tenant(self, tenants: Sequence[str]) -> str:
        """The tenant with the fewest cached chars, ties in the given (registry) order."""
        return first_argmin(tenants, key=self.tenant_chars)
