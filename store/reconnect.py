"""How a background Redis loop waits before it tries again after an error: redis-py's exponential
backoff with full jitter, so gateways that lost Redis together do not reconnect in lockstep."""

from __future__ import annotations

from redis.backoff import ExponentialWithJitterBackoff

# 1st retry within 0.25 s, doubling up to 5 s (each a uniform draw below the bound)
RECONNECT = ExponentialWithJitterBackoff(cap=5.0, base=0.25)


def delay_s(failures: int) -> float:
    """Seconds to wait after the `failures`-th consecutive failure (>= 1)."""
    return float(RECONNECT.compute(failures))
