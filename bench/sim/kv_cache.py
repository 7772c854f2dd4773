"""KV pool accounting and prefix cache of one simulated worker (bench/sim/engine.py's model).

Pure and synchronous. `PrefixCache` counts never-used/freed engine blocks, ref-counts the cached blocks
running requests pin, keeps the unpinned ones in an LRU queue (evicted head first) and optionally records
vLLM-style KV events ("stored" | "removed" | "cleared", keys). `overlay()` gives a copy-on-write view for the
engine's look-ahead, so a look-ahead costs what it touches rather than the cache size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import cast


class PrefixCache:
    """KV pool accounting and prefix cache: ref counts of cached blocks, LRU of the unpinned ones."""

    __slots__ = ("events", "evictable", "free", "lru", "pinned", "ref", "size")

    def __init__(self, num_blocks: int, record: bool) -> None:
        self.size: dict[Hashable, int] = {}  # cached key -> engine blocks
        self.ref: dict[Hashable, int] = {}  # cached key -> running requests using it
        self.lru: OrderedDict[Hashable, None] = OrderedDict()  # unpinned cached keys, eviction order
        self.free = num_blocks  # never-used or freed engine blocks (< 0 only when over-committed)
        self.evictable = 0  # engine blocks held by unpinned cached keys
        self.pinned = 0  # engine blocks held by pinned cached keys
        self.events: list[tuple[str, list[Hashable]]] | None = [] if record else None

    def overlay(self) -> PrefixCache:
        """A copy-on-write view for look-ahead: reads fall through to this cache, which it never changes
        (so next_event_s() costs what the look-ahead touches, not the cache size)."""
        twin = PrefixCache.__new__(PrefixCache)
        twin.size = cast(dict[Hashable, int], _MapOverlay(self.size))
        twin.ref = cast(dict[Hashable, int], _MapOverlay(self.ref))
        twin.lru = cast("OrderedDict[Hashable, None]", _LruOverlay(self.lru))
        twin.free, twin.evictable, twin.pinned, twin.events = self.free, self.evictable, self.pinned, None
        return twin

    def _emit(self, kind: str, key: Hashable) -> None:
        if self.events is not None:
            if self.events and self.events[-1][0] == kind:
                self.events[-1][1].append(key)
            else:
                self.events.append((kind, [key]))

    def pin(self, key: Hashable) -> None:
        self.pin_all((key,))

    def pin_all(self, keys: Iterable[Hashable]) -> None:
        """Pin each key in turn: a cached block leaves the LRU queue at its first pin (one call per request:
        a long prompt pins hundreds of blocks)."""
        ref, lru, size = self.ref, self.lru, self.size
        moved = 0
        for key in keys:
            count = ref[key]
            if count == 0:
                del lru[key]
                moved += size[key]
            ref[key] = count + 1
        self.evictable -= moved
        self.pinned += moved

    def unpin_all(self, keys: Iterable[Hashable]) -> None:
        """Unpin each key in turn, in the given order: a block rejoins the LRU queue, evictable, at its last
        unpin (the given order is the queue's order on release)."""
        ref, lru, size = self.ref, self.lru, self.size
        moved = 0
        for key in keys:
            count = ref[key] - 1
            ref[key] = count
            if count == 0:
                lru[key] = None
                moved += size[key]
        self.evictable += moved
        self.pinned -= moved

    def insert_pinned(self, key: Hashable, size: int) -> None:
        """Turn `size` engine blocks a request already holds into the cached block `key`, pinned once."""
        self.size[key] = size
        self.ref[key] = 1
        self.pinned += size
        self._emit("stored", key)

    def take(self, blocks: int) -> None:
        """Allocate engine blocks, evicting least recently used unpinned blocks while short."""
        if self.free < blocks and self.lru:
            lru, size, ref, events = self.lru, self.size, self.ref, self.events
            while self.free < blocks and lru:  # _evict_one, inlined: this loop is the simulator's hottest
                key = lru.popitem(last=False)[0]
                freed = size.pop(key)
                del ref[key]
                self.evictable -= freed
                self.free += freed
                if events is not None:
                    self._emit("removed", key)
        self.free -= blocks

    def _evict_one(self, kind: str) -> None:
        key, _ = self.lru.popitem(last=False)
        size = self.size.pop(key)
        del self.ref[key]
        self.evictable -= size
        self.free += size
        self._emit(kind, key)

    def clear(self) -> None:
        while self.lru:
            self._evict_one("cleared")


class _MapOverlay:
    """The dict operations PrefixCache uses, over a base dict that stays untouched."""

    __slots__ = ("base", "gone", "local")

    def __init__(self, base: dict[Hashable, int]) -> None:
        self.base, self.local, self.gone = base, dict[Hashable, int](), set[Hashable]()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.local or (key in self.base and key not in self.gone)

    def __getitem__(self, key: Hashable) -> int:
        if key in self.local:
            return self.local[key]
        if key in self.gone:
            raise KeyError(key)
        return self.base[key]

    def __setitem__(self, key: Hashable, value: int) -> None:
        self.local[key] = value

    def __delitem__(self, key: Hashable) -> None:
        if key not in self:
            raise KeyError(key)
        self.local.pop(key, None)
        if key in self.base:
            self.gone.add(key)

    def pop(self, key: Hashable) -> int:
        value = self[key]
        del self[key]
        return value


class _LruOverlay:
    """The OrderedDict operations PrefixCache uses on its LRU queue, over a base queue that stays untouched:
    base keys in order minus those taken out, then keys appended since."""

    __slots__ = ("base", "gone", "order", "tail")

    def __init__(self, base: OrderedDict[Hashable, None]) -> None:
        self.base, self.gone = base, set[Hashable]()
        self.order = iter(base)
        self.tail: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.base) - len(self.gone) + len(self.tail)

    def __setitem__(self, key: Hashable, value: None) -> None:
        self.tail[key] = value  # only keys not in the queue are appended

    def __delitem__(self, key: Hashable) -> None:
        if key in self.tail:
            del self.tail[key]
        else:
            self.gone.add(key)

    def popitem(self, last: bool = True) -> tuple[Hashable, None]:
        for key in self.order:
            if key not in self.gone:
                self.gone.add(key)
                return key, None
        return self.tail.popitem(last=False)
