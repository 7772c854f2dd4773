"""The autoscaling signal: per-model queue length and expected queue wait, refreshed in the background.

Scaling inference workers on GPU utilization reacts late and wrongly (a saturated worker can show
high utilization while its queue grows without bound, and an idle cache-heavy one can show low):
scale on what users feel instead, the expected wait in the global admission queue. About once a
second this task reads the model's admission state from Redis (`SlotPool.snapshot`, one script call
per model) and sets two gauges on the gateway's /metrics:

    kvgate_global_queue_length{model,band}      requests of all gateways waiting, per band
    kvgate_expected_queue_wait_seconds{model}   wait of a request arriving now at the back of the queues

The same read feeds the sustained-pressure tracker (policy/pressure.py) that sheds low-priority
requests at the door while the higher bands keep waiting, and notices run-time quota changes (an
operator's `HSET kvg:{m}:quota ...` or `set_quota()`) and logs them, so every gateway's log says
when its limits changed (within ~1 s).
docs/OPERATIONS.md shows the HPA and KEDA objects that scale on the expected wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from redis.exceptions import RedisError

from plugin.metrics import GatewayMetrics
from policy.pressure import PressureTracker
from policy.types import Band
from runtime.tasks import Background, every
from store.slots import SlotPool

logger = logging.getLogger(__name__)

REFRESH_S = 1.0


@dataclass(frozen=True)
class QueueSignal:
    """One model's autoscaling signal, read from its admission snapshot."""

    queued: Mapping[str, int]  # band name -> waiters
    expected_wait_s: float


def signal_of(snapshot: Mapping[str, Any]) -> QueueSignal:
    return QueueSignal(
        queued={band: int(n) for band, n in snapshot["queued"].items()},
        expected_wait_s=float(snapshot.get("est_wait_s", 0.0)),
    )


def quota_change(old: Mapping[str, str] | None, new: Mapping[str, str]) -> str | None:
    """A readable description of what changed between two quota hashes; None if nothing did (or if
    `old` is None: the first read is a baseline, not a change)."""
    if old is None or dict(old) == dict(new):
        return None
    parts = []
    for key in sorted({*old, *new}):
        before, after = old.get(key), new.get(key)
        if before != after:
            parts.append(
                f"{key} {before if before is not None else '-'} -> {after if after is not None else '-'}"
            )
    return ", ".join(parts)


@dataclass(eq=False)
class QueueSignalRefresher:
    """Background task: every `period_s`, read each model's admission state and set the gauges."""

    pool: SlotPool
    metrics: GatewayMetrics
    models: Callable[[], Iterable[str]]
    _: KW_ONLY
    period_s: float = REFRESH_S
    pressure: PressureTracker | None = None
    clock: Callable[[], float] = time.monotonic
    # model -> last quota hash seen
    quotas: dict[str, dict[str, str]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._loop = Background("kvgate-queue-signal")

    async def start(self) -> None:
        # (a TimeoutError is an OSError)
        self._loop.start(
            every(self.period_s, self.refresh_once, errors=(RedisError, OSError), on_error=_failed)
        )

    async def close(self) -> None:
        await self._loop.stop()

    async def refresh_once(self) -> dict[str, QueueSignal]:
        """Read every model's state once, set the gauges, log quota changes; returns the signals."""
        signals: dict[str, QueueSignal] = {}
        for model in sorted(set(self.models())):
            snapshot = await asyncio.wait_for(self.pool.snapshot(model), 2.0)
            signal = signals[model] = signal_of(snapshot)
            for band, queued in signal.queued.items():
                self.metrics.global_queue.set(queued, model, band)
            self.metrics.expected_wait.set(signal.expected_wait_s, model)
            if self.pressure is not None:
                by_band = {Band.parse(band): n for band, n in signal.queued.items()}
                self.pressure.observe(model, by_band, self.clock())
            self._note_quota(model, {str(k): str(v) for k, v in snapshot["quota"].items()})
        return signals

    def _note_quota(self, model: str, quota: dict[str, str]) -> None:
        change = quota_change(self.quotas.get(model), quota)
        if change is not None:
            logger.info("kvgate: admission quota of %s changed at run time: %s", model, change)
        self.quotas[model] = quota


def _failed(e: Exception) -> None:
    logger.debug("queue signal refresh failed: %s", e)
