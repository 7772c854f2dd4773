"""The request path's mutable, process-wide state: draining, and who waits for admission.

`ProcessState` is shared by intake (refuses new requests while draining), admission (registers the
hook task waiting for a slot), the addon's `client_disconnected` (cancels a departed client's waits)
and the local endpoints (queue length, health).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ProcessState:
    draining: bool = False
    waiters: dict[str, set[asyncio.Task[Any]]] = field(default_factory=dict)  # client id -> its hooks waiting
    disconnected: set[asyncio.Task[Any]] = field(default_factory=set)  # of those, cancelled: the client left
    queued: dict[str, int] = field(default_factory=dict)  # model -> requests of this process waiting

    def client_left(self, client_id: str) -> None:
        """Cancel the waits of a client that disconnected (admission takes the cancellation back)."""
        for task in self.waiters.pop(client_id, ()):
            self.disconnected.add(task)
            task.cancel()

    def queued_total(self) -> int:
        return sum(self.queued.values())
