"""Reads of the user's state, run on the training thread for the quorum thread.

A state_dict may issue collectives over the group's process group: torchtitan's
fused-QKV hook redistributes each FSDP-sharded weight when it is saved. Called
from the quorum thread, such a collective races the training thread's own
(FSDP's all-gathers) and gloo aborts or waits forever. So the quorum thread
asks, and the training thread reads the state when it next waits on the
Manager (an allreduce, should_commit, a synchronous quorum): every rank of a
group is then at the same point of its program, as collectives need.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torchft_like.manager import threads


class TrainingThreadReads:
    def __init__(self) -> None:
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._request: tuple[Callable[[], Any], Future[Any]] | None = None

    def wake(self) -> None:
        """Tells a waiting training thread to look at its condition again."""
        self._wake.set()

    def event(self) -> threading.Event:
        """An Event whose set() also wakes the training thread."""
        wake = self.wake

        class _Waking(threading.Event):
            def set(self) -> None:
                super().set()
                wake()

        return _Waking()

    def read(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """Quorum thread: `fn()` as run by the training thread at its next wait.

        Raises:
            TimeoutError: the training thread made no Manager call that waits
                within `timeout_s`; the request is withdrawn.
            Exception: whatever `fn` raised.
        """
        threads.check(threads.QUORUM, what="a read on the training thread")
        future: Future[Any] = Future()
        with self._lock:
            self._request = (fn, future)
        self._wake.set()
        try:
            return future.result(timeout_s)
        except TimeoutError:
            with self._lock:
                if self._request is not None and self._request[1] is future:
                    self._request = None
                    raise TimeoutError(
                        f"the training thread made no Manager call within {timeout_s:g} s "
                        "(the Manager's timeout) to read the state for a healing peer"
                    ) from None
            return future.result()  # taken just now: it is running or done

    def wait(self, done: Callable[[], bool]) -> None:
        """Training thread: blocks until `done()`, running reads meanwhile."""
        if done():  # the per-allreduce case: the quorum thread asks nothing once done
            return
        while True:
            self._wake.clear()
            self._run_request()
            if done():
                return
            self._wake.wait()

    def _run_request(self) -> None:
        with self._lock:
            request, self._request = self._request, None
        if request is None:
            return
        fn, future = request
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the quorum thread, which reports it
            future.set_exception(e)
