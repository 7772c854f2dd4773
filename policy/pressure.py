"""Sustained pressure: when to shed batch traffic at the door (issue 4, degradation).

Under a short burst the global queues absorb the excess and every band is served in priority order.
When the bands above LOW have had waiters continuously for `after_s`, the burst is not short: new
LOW (offline / batch) requests are refused at once with a clear reason, so they neither take seats
that online traffic needs as it frees them nor sit in a queue they would time out of. The moment
the higher bands' queues empty, the pressure ends and LOW is admitted again.

Pure: the gateway feeds observations of the global queue (plugin/autoscale.py reads it from Redis
about once a second, so every gateway sees the same pressure) and asks with its own clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policy.types import Band


def waiting_above_low(queued: Mapping[Band, int]) -> bool:
    """True if any band more urgent than LOW has a waiter."""
    return any(n > 0 for band, n in queued.items() if band > Band.LOW)


@dataclass(slots=True)
class PressureTracker:
    """Per model: since when the bands above LOW have had waiters (None = not under pressure)."""

    since_s: dict[str, float] = field(default_factory=dict)

    def observe(self, model: str, queued: Mapping[Band, int], now_s: float) -> None:
        if waiting_above_low(queued):
            self.since_s.setdefault(model, now_s)
        else:
            self.since_s.pop(model, None)

    def pressure_s(self, model: str, now_s: float) -> float:
        """How long the model has been under pressure (0 when it is not)."""
        since = self.since_s.get(model)
        return 0.0 if since is None else max(0.0, now_s - since)

    def sheds(self, model: str, band: Band, now_s: float, after_s: float) -> bool:
        """Refuse this request at the door? Only LOW, only after `after_s` of pressure (0 = never)."""
        return band == Band.LOW and after_s > 0 and self.pressure_s(model, now_s) >= after_s
