"""A/B split: which arm a request belongs to, so a share of traffic is routed with a candidate policy.

The assignment is a pure function of a stable key (the tenant, or the request's first prefix block,
which every turn of a conversation shares), so a conversation stays in one arm across requests and
across gateways, with no state to share.
"""

from __future__ import annotations

import zlib

DEFAULT_ARM = "default"
CANDIDATE_ARM = "candidate"
SPLIT_KEYS = ("prefix", "tenant")

_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads nearby block hashes over [0, 1)
_MASK = (1 << 64) - 1


def arm_fraction(key: int | str) -> float:
    """A key's stable position in [0, 1)."""
    if isinstance(key, str):
        key = zlib.crc32(key.encode())
    return ((key * _GOLDEN) & _MASK) / (1 << 64)


def arm_of(share: float, tenant: str, prefix_hashes: tuple[int, ...], by: str) -> str:
    """`CANDIDATE_ARM` for `share` of the keys (by "tenant" or "prefix"), else `DEFAULT_ARM`."""
    if share <= 0.0:
        return DEFAULT_ARM
    key: int | str = tenant if by == "tenant" or not prefix_hashes else prefix_hashes[0]
    return CANDIDATE_ARM if arm_fraction(key) < share else DEFAULT_ARM
