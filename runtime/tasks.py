"""Background tasks that are neither garbage-collected mid-run nor fail silently.

The asyncio loop keeps only weak references to tasks, so a task nobody holds can vanish before it
finishes; an exception in a task nobody awaits is only reported when the task is collected, if ever.
`spawn()` is the one place kvgate creates tasks (ruff TID251 bans raw `asyncio.create_task`): it
keeps a strong reference until the task is done and logs any exception it ends with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# strong references to running tasks; each removes itself when done
_RUNNING: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
    """Run `coro` as a task named `name`; keep it alive until done and log an exception it raises.

    Cancel the returned task to stop it (and await it to wait for the stop); cancellation is not
    logged as an error.
    """
    task = asyncio.create_task(coro, name=name)  # noqa: TID251 - this is the sanctioned wrapper
    _RUNNING.add(task)
    task.add_done_callback(_finished)
    return task


def running() -> int:
    """Tasks started by `spawn()` that have not finished yet (for tests and shutdown logs)."""
    return len(_RUNNING)


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the given tasks (None is skipped) and wait until each has finished."""
    live = [t for t in tasks if t is not None and not t.done()]
    for task in live:
        task.cancel()
    if live:
        await asyncio.gather(*live, return_exceptions=True)


class Background:
    """An owner's one background task: `start(coro)` runs it, `stop()` cancels it and waits.

    `running` holds from `start()` until `stop()` has finished, also if the task ended early.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self, coro: Coroutine[Any, Any, None]) -> None:
        self._task = spawn(coro, name=self.name)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None


async def every(
    period_s: float,
    step: Callable[[], Awaitable[object]],
    *,
    errors: tuple[type[Exception], ...],
    on_error: Callable[[Exception], None],
    wait_first: bool = False,
) -> None:
    """Await `step()` every `period_s` seconds until cancelled (the first after one period with
    `wait_first`); an exception of `errors` goes to `on_error` and the loop carries on."""
    if wait_first:
        await asyncio.sleep(period_s)
    while True:
        try:
            await step()
        except errors as e:
            on_error(e)
        await asyncio.sleep(period_s)


def _finished(task: asyncio.Task[Any]) -> None:
    _RUNNING.discard(task)
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("task %s failed", task.get_name(), exc_info=exc)
