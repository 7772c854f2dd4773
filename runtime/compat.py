"""Python 3.11 compatibility: `asyncio.wait_for` with the 3.12 semantics that every task cancel relies on.

On Python < 3.12, `asyncio.wait_for` returns the inner result and drops the caller's cancellation
when both land in the same loop tick (CPython gh-86296; 3.12 rewrote it on `asyncio.timeout`).
redis-py wraps every command it sends in `wait_for` (its default `socket_timeout` is 5 s), so a
background loop cancelled while a command completes carries on, and the `cancel_and_wait()` that
stops it (runtime/tasks.py) hangs for ever; a queued request's cancel can be lost the same way.
`install()` swaps in the 3.12 implementation, for redis-py's calls and ours; on 3.12+ it does nothing.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

_stdlib_wait_for = asyncio.wait_for


async def wait_for(fut: Awaitable[T], timeout: float | None) -> T:
    """`asyncio.wait_for` as in Python 3.12: a timeout scope around the await, so a cancel always raises."""
    if timeout is not None and timeout <= 0:
        return await _stdlib_wait_for(fut, timeout)  # cancels at once, no race to lose (same as 3.12)
    async with asyncio.timeout(timeout):
        return await fut


def install() -> None:
    """Replace `asyncio.wait_for` by `wait_for` above on Python < 3.12 (idempotent)."""
    if sys.version_info < (3, 12):
        asyncio.wait_for = asyncio.tasks.wait_for = wait_for  # type: ignore[assignment]
