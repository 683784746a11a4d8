"""An asyncio loop in a daemon thread, for servers living inside another process."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

_MAX_PARKED = 4
"""Stopped loops kept running for reuse. grpc.aio keeps a reference to every
event loop it has served in a process-wide table, and never drops it: a new
loop per server would grow that table (and memory) with each server a process
starts and stops. Reusing loops bounds it by the most servers alive at once."""
_parked: list[tuple[asyncio.AbstractEventLoop, threading.Thread]] = []
_parked_lock = threading.Lock()


class BackgroundLoop:
    """Runs coroutines on a private event loop so that a training process (or
    a test) can host gRPC servers without giving its main thread to asyncio.

    Each live instance has a loop of its own; `stop()` hands it back for the
    next instance (see _MAX_PARKED) once its leftover tasks are cancelled.
    """

    def __init__(self, name: str) -> None:
        with _parked_lock:
            reused = _parked.pop() if _parked else None
        if reused is not None:
            self.loop, self._thread = reused
            self._thread.name = name
        else:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
            self._thread.start()
        self._stopped = False

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs `coro` on the loop and waits for its result from this thread.

        Raises:
            RuntimeError: after `stop()` (the loop may serve another owner now).
        """
        if self._stopped:
            coro.close()
            raise RuntimeError("this server has shut down; its event loop is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Idempotent. Must not be called from the loop's own thread."""
        if self._stopped or self.loop.is_closed():
            return
        self._stopped = True
        try:
            asyncio.run_coroutine_threadsafe(_cancel_leftovers(), self.loop).result(5)
        except Exception as e:  # tasks that refuse to end: do not reuse this loop
            logger.debug("leftover tasks did not end, closing the loop: %s", e)
        else:
            with _parked_lock:
                if len(_parked) < _MAX_PARKED and self._thread.is_alive():
                    _parked.append((self.loop, self._thread))
                    return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_leftovers() -> None:
    """Ends what the previous owner left running, so the next owner starts clean."""
    me = asyncio.current_task()
    leftovers = [t for t in asyncio.all_tasks() if t is not me]
    for task in leftovers:
        task.cancel()
    await asyncio.gather(*leftovers, return_exceptions=True)
