"""An asyncio loop on a virtual clock, for unit tests of timers without
waiting on a real one: when nothing is ready, the loop's time jumps to its
next timer at once. Sockets still work (its selector is a real one, polled
without blocking)."""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class _JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> Any:
        ready = super().select(0)
        if not ready:
            if timeout is None:
                raise RuntimeError("the loop waits for nothing that can come: no timer, no I/O")
            self._loop.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """`time()` is `now`, which only the loop's idle waits move."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now
