"""Event-loop helpers for servers: a loop in a daemon thread for servers living
inside another process, and deadlines that leave room for the reason."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
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

    def __init__(self, name: str, batch: bool = False) -> None:
        """`batch`: run the loop's thread under SCHED_BATCH (set_batch_policy)."""
        with _parked_lock:
            reused = _parked.pop() if _parked else None
        if reused is not None:
            self.loop, self._thread = reused
            self._thread.name = name
        else:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
            self._thread.start()
        # Before anything this owner runs there; a reused thread keeps its last owner's policy.
        self.loop.call_soon_threadsafe(set_batch_policy, batch)
        self._stopped = False

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs `coro` on the loop and waits for its result from this thread.

        Raises:
            RuntimeError: after `stop()` (the loop may serve another owner now).
            LoopStalledError: `coro` did not finish within `timeout`; it is
                cancelled. Whatever `coro` raises itself (a TimeoutError
                included) is raised as it is.
        """
        if self._stopped:
            coro.close()
            raise RuntimeError("this server has shut down; its event loop is stopped")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        # Not future.result(timeout): its TimeoutError is the class coro's own
        # timeouts have on Python >= 3.11, and the reason they carry would be lost.
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:
            future.cancel()
            raise LoopStalledError(f"the server's event loop gave no answer within {timeout} s")
        return future.result()

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


def set_batch_policy(batch: bool) -> None:
    """Puts the calling thread under Linux's SCHED_BATCH (`batch`) or back
    under SCHED_OTHER.

    Why: a SCHED_OTHER thread woken on a host whose cores are all busy
    preempts a running thread at once. A training process's control loop
    wakes a few times a step (the quorum's answer, a vote), and each wake-up
    cut into the training threads: 4-6% of a 4M-parameter step on 2 busy
    cores (bench/NOTES.md, "Sixth pass"). A SCHED_BATCH thread gets the same
    share of CPU but does not preempt: it runs on a free core, or when the
    running thread blocks (an allreduce waiting on peers) or ends its slice
    (a few ms). With a core to spare (a GPU host) nothing changes. Elsewhere
    (not Linux, a sandbox that forbids the call) the thread stays as it is.
    """
    if not hasattr(os, "sched_setscheduler"):
        return
    policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
    try:
        if os.sched_getscheduler(0) != policy:
            os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as e:
        logger.debug("scheduling policy %s not set: %s", policy, e)


class LoopStalledError(RuntimeError):
    """A call into a BackgroundLoop did not finish within its bound."""


REPLY_MARGIN_S = 0.1
"""How long before a caller's deadline a server answers (10% of the time
left when that is less): the caller then hears why nothing was decided
instead of its own bare "Deadline Exceeded"."""


def reply_budget_s(time_remaining_s: float | None) -> float | None:
    """The time a server may wait on behalf of a caller with `time_remaining_s` left."""
    if time_remaining_s is None:
        return None
    return max(time_remaining_s - min(REPLY_MARGIN_S, 0.1 * time_remaining_s), 0.0)


async def wait_for_future(
    future: asyncio.Future[T], timeout_s: float | None, on_timeout: Callable[[], Exception]
) -> T:
    """wait_within(asyncio.shield(future), ...) in fewer turns of the loop:
    `future`'s outcome, or `on_timeout()` after `timeout_s`; neither that nor
    cancelling the caller touches `future`, which someone else owns."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[bool] = loop.create_future()

    def arrived(_: object) -> None:
        if not waiter.done():
            waiter.set_result(True)

    future.add_done_callback(arrived)
    timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
    try:
        if not await waiter:
            raise on_timeout()
    finally:
        future.remove_done_callback(arrived)
        if timer is not None:
            timer.cancel()
    return future.result()


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


async def wait_within(
    awaitable: Awaitable[T], timeout_s: float | None, on_timeout: Callable[[], Exception]
) -> T:
    """Awaits `awaitable` for at most `timeout_s` (None: no bound), then cancels
    it and raises `on_timeout()`, built at that moment so it can say what was
    still missing. Unlike asyncio.wait_for, an error the awaitable raises
    itself, a TimeoutError included, comes through unchanged."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise on_timeout()
    return task.result()
