"""Release batching: the leases the flows give back, sent together once per loop tick.

A flow's `release` hook must stay near-instant (the last chunk is sent only after it returns), so
`Releaser.release()` only queues the lease; a background loop sends what one loop tick queued in one
pipelined round trip (no task per request), after the response that gave it back was written. A failed
send is logged: the leases expire on their own. The same loop runs the answered flows' bookkeeping
(`after_response`: their metrics and decision records) once their responses are out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from runtime.tasks import Background, spawn
from store.slots import Lease, SlotPool

logger = logging.getLogger(__name__)


class Releaser:
    """Gives leases back to the slot pool in batches; `start()` the loop, `close()` sends the rest."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.released = 0  # leases handed to `release()` (queued; see the pool for what reached Redis)
        self._queued: list[Lease] = []
        self._later: list[Callable[[], None]] = []  # bookkeeping of answered flows (after_response)
        self._wake = asyncio.Event()
        self._loop = Background("kvgate-release")

    def after_response(self, step: Callable[[], None]) -> None:
        """Run `step` once the response being answered now has been written (the loop's next pass,
        before that pass's releases are sent); at once when no loop runs. A failing step is logged."""
        if not self._loop.running:
            _run_step(step)
            return
        if not self._later:
            self._wake.set()
        self._later.append(step)

    def release(self, lease: Lease) -> None:
        """Give `lease` back soon (in the next batch)."""
        self.released += 1
        if not self._queued:
            self._wake.set()
        self._queued.append(lease)
        if not self._loop.running:  # no release loop (not started, or stopping): send it now
            spawn(self.send_queued(), name="kvgate-release-late")

    async def start(self) -> None:
        self._loop.start(self._run())

    async def close(self) -> None:
        """Stop the loop and send what the flows gave back last."""
        await self._loop.stop()
        steps, self._later = self._later, []
        for step in steps:
            _run_step(step)
        await self.send_queued()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Let the response that gave the lease back reach its client first: mitmproxy writes it one
            # loop iteration after the `response` hook returns (with Python >= 3.12's eager tasks, the
            # hook task then waits for its connection's event lock), and this task, woken during the
            # hook, would otherwise pack and send the batch before that write.
            await asyncio.sleep(0)
            steps, self._later = self._later, []
            for step in steps:
                _run_step(step)
            await self.send_queued()

    async def send_queued(self) -> None:
        batch, self._queued = self._queued, []
        if not batch:
            return
        try:
            await self.pool.release_many(batch)
        except (RedisError, OSError) as e:  # the leases expire on their own
            logger.warning("release of %d leases failed: %s", len(batch), e)


def _run_step(step: Callable[[], None]) -> None:
    try:
        step()
    except Exception:  # bookkeeping only: the request itself is answered and settled
        logger.exception("kvgate: accounting of an answered request failed")
