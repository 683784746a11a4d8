"""Fixtures shared by the unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.unit.virtual_clock import VirtualClockLoop


@pytest.fixture
def loop() -> Iterator[VirtualClockLoop]:
    """The event loop of a test's connections, on a virtual clock (set, not running)."""
    loop = VirtualClockLoop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()
