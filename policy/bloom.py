"""`BloomSummary`: a worker's cached blocks as a Bloom filter with a chosen false-positive rate.

The bounded alternative to an exact set (policy/index.py's LRU): a fixed size whatever the block count,
m = -n ln p / (ln 2)^2 bits and k = (m / n) ln 2 probes for n blocks at false-positive rate p (about
9.6 bits per block at 1 %, against ~80 bytes per entry of a Redis ZSET). It cannot forget one block, so
a publisher rebuilds it from its exact set (each heartbeat) rather than deleting. A false positive makes
a worker look as if it held one more block; `match` (leading blocks held, stopping at the first miss)
carries that on only while the following blocks are false positives too. bench/index_size.py measures
the cost on the Mooncake trace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: block hashes from a trace (small dense ints) spread over 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def bloom_bits(entries: int, fp_rate: float) -> int:
    """Bits for `entries` members at false-positive rate `fp_rate` (at least 64)."""
    if not 0.0 < fp_rate < 1.0:
        raise ValueError(f"fp_rate must be in (0, 1), not {fp_rate}")
    return max(64, math.ceil(-max(1, entries) * math.log(fp_rate) / math.log(2) ** 2))


class BloomSummary:
    """A Bloom filter over 64-bit block hashes, sized for `entries` members at `fp_rate`."""

    def __init__(self, entries: int, fp_rate: float) -> None:
        self.bits = bloom_bits(entries, fp_rate)
        self.probes = max(1, round(self.bits / max(1, entries) * math.log(2)))
        self._array = bytearray((self.bits + 7) // 8)

    @classmethod
    def of(cls, hashes: Sequence[int], fp_rate: float) -> BloomSummary:
        summary = cls(len(hashes), fp_rate)
        summary.update(hashes)
        return summary

    @property
    def size_bytes(self) -> int:
        return len(self._array)

    def _positions(self, block_hash: int) -> Iterable[int]:
        x = _mix(block_hash & _MASK)
        h1, h2 = x & 0xFFFFFFFF, (x >> 32) | 1  # double hashing (Kirsch-Mitzenmacher)
        return ((h1 + i * h2) % self.bits for i in range(self.probes))

    def update(self, hashes: Iterable[int]) -> None:
        array = self._array
        for h in hashes:
            for p in self._positions(h):
                array[p >> 3] |= 1 << (p & 7)

    def __contains__(self, block_hash: int) -> bool:
        array = self._array
        return all(array[p >> 3] & (1 << (p & 7)) for p in self._positions(block_hash))

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` the filter says it holds (a false positive counts as held)."""
        n = 0
        for h in hashes:
            if h not in self:
                break
            n += 1
        return n
