"""Works and futures that ProcessGroupGloo builds from gloo's own.

gloo's failures must reach the caller unwrapped, several gloo works must read
as one, and gloo's send/recv work has no future at all: the three shapes
live here, apart from the group's configure and error logic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchft_like._work import FutureWork


def _then(fut: torch.futures.Future[Any], fn: Callable[[Any], Any]) -> torch.futures.Future[Any]:
    """Like `fut.then(fn)`, but a failure of `fut` passes through unwrapped
    (`then` would bury gloo's message in a "running the callback" error)."""
    out: torch.futures.Future[Any] = torch.futures.Future()

    def settle(done: torch.futures.Future[Any]) -> None:
        try:
            result = fn(done.value())
        except Exception as e:
            out.set_exception(e)
        else:
            out.set_result(result)

    fut.add_done_callback(settle)
    return out


def _all_of(works: list[dist.Work], value: Any) -> dist.Work:
    """One Work for several: done when all are, failing with the first failure."""
    futures = [w.get_future() for w in works]
    out: torch.futures.Future[Any] = torch.futures.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def settle(done: torch.futures.Future[Any]) -> None:
        try:
            done.value()
        except Exception as e:
            with lock:
                if not out.done():
                    out.set_exception(e)
            return
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0 and not out.done():
                out.set_result(value)

    if not futures:
        out.set_result(value)
    for fut in futures:
        fut.add_done_callback(settle)
    return FutureWork(out)


class _P2PWork(dist.Work):
    """Gloo's send/recv work has no future: this one records a failure seen
    by wait(), and builds a future on demand from a helper thread."""

    def __init__(self, work: dist.Work, tensors: list[torch.Tensor], on_error: Any) -> None:
        super().__init__()
        self._work, self._tensors, self._on_error = work, tensors, on_error
        self._future: torch.futures.Future[Any] | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            return self._work.wait(timeout) if timeout else self._work.wait()
        except Exception as e:
            self._on_error(e)
            raise

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future[Any]:
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                threading.Thread(target=self._settle, name="torchft-p2p", daemon=True).start()
            return self._future

    def _settle(self) -> None:
        assert self._future is not None
        try:
            self.wait()
        except Exception as e:
            self._future.set_exception(e)
        else:
            self._future.set_result(self._tensors)
