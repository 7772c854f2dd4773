"""The one polling helper the tests use: wait for a condition, never a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def until(
    check: Callable[[], bool | Awaitable[bool]],
    what: str = "the condition",
    timeout_s: float = 5.0,
    interval_s: float = 0.01,
) -> None:
    """Poll `check` (plain or async) until it is true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)
