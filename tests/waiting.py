"""Waiting in tests: on a condition, with a deadline, never a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

What = str | Callable[[], str]
"""What is waited for; a function is called at the deadline only, for a
message with what was seen by then (a log's tail, the records so far)."""


def _timed_out(timeout: float, what: What) -> str:
    return f"timed out after {timeout} s waiting for {what() if callable(what) else what}"


def wait_until(
    condition: Callable[[], object], timeout: float = 10.0, what: What = "the condition"
) -> None:
    """Returns once `condition()` is true; fails naming `what` at the deadline.

    A condition that must fail at once (a child died, a thread raised)
    asserts so itself."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, _timed_out(timeout, what)
        time.sleep(0.02)


async def wait_until_async(
    condition: Callable[[], object], timeout: float = 10.0, what: What = "the condition"
) -> None:
    """wait_until for a coroutine on the loop that makes `condition` true.

    `condition` may be a coroutine function (each try a call on the loop,
    e.g. a heartbeat sent): its result is awaited."""
    deadline = time.monotonic() + timeout
    while True:
        met = condition()
        if inspect.isawaitable(met):
            met = await met
        if met:
            return
        assert time.monotonic() < deadline, _timed_out(timeout, what)
        await asyncio.sleep(0.02)
