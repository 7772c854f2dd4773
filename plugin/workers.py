"""Which workers a request may go to: the mirrored registry minus the workers that just refused us.

`WorkerPool` owns the skip-refused-worker rule: a worker that refused a connection is skipped for
`SUSPECT_S` (unless no other worker would be left), so the next requests do not pay for the same
failure before its lease runs out.
"""

from __future__ import annotations

import time

from plugin.flow import Route
from plugin.mirror import ClusterMirror
from store.registry import WorkerRecord

SUSPECT_S = 5.0  # a worker that refused a connection is skipped this long (unless it is the only one)


class WorkerPool:
    """The workers of each model as this gateway sees them (plugin/mirror.py), for the request path."""

    def __init__(self, mirror: ClusterMirror | None) -> None:
        self.mirror = mirror
        self.suspects: dict[tuple[str, str], float] = {}  # (model, worker) -> skip until (monotonic)

    def known(self, model: str) -> list[WorkerRecord]:
        """Every registered worker of `model`, live or not (an empty list: no worker serves it)."""
        return self.mirror.workers(model) if self.mirror else []

    def routable(self, model: str) -> list[WorkerRecord]:
        """Live, non-draining workers of `model`, minus recently refused ones (unless none would be left)."""
        if self.mirror is None:
            return []
        workers = self.mirror.routable(model)
        if self.suspects:
            now = time.monotonic()
            ok = [w for w in workers if self.suspects.get((model, w.id), 0.0) <= now]
            return ok or workers
        return workers

    def suspect(self, route: Route) -> None:
        """The route's worker refused the connection: skip it for a while."""
        self.suspects[(route.model, route.worker.id)] = time.monotonic() + SUSPECT_S
