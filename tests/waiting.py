"""Waiting in tests: on a condition, with a deadline, never a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object], timeout: float = 10.0, what: str = "the condition"
) -> None:
    """Returns once `condition()` is true; fails naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


async def wait_until_async(
    condition: Callable[[], object], timeout: float = 10.0, what: str = "the condition"
) -> None:
    """wait_until for a coroutine on the loop that makes `condition` true."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.02)
