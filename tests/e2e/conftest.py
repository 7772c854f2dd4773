"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.e2e.harness import SseUpstream


@pytest.fixture
async def upstream() -> AsyncIterator[SseUpstream]:
    """The controllable SSE upstream serving model "m" (holds streams until `release` is set)."""
    up = await SseUpstream("m").start()
    try:
        yield up
    finally:
        await up.close()
