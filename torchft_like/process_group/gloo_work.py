"""Works and futures that ProcessGroupGloo builds from gloo's own.

gloo's failures must reach the caller unwrapped, several gloo works must read
as one, gloo's send/recv work has no future at all, and the collectives gloo
runs on host memory only need CUDA tensors staged: these shapes live here,
apart from the group's configure and error logic. Futures that hold CUDA
tensors are CUDA-aware (`future_for`), so a waiter's streams wait on them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchft_like._work import FutureWork, future_for


def then(
    fut: torch.futures.Future[Any], fn: Callable[[Any], Any], like: Any = None
) -> torch.futures.Future[Any]:
    """Like `fut.then(fn)`, but a failure of `fut` passes through unwrapped
    (`then` would bury gloo's message in a "running the callback" error).
    `like`: what the result will hold (its CUDA devices)."""
    out = future_for(like)

    def settle(done: torch.futures.Future[Any]) -> None:
        try:
            result = fn(done.value())
        except Exception as e:
            out.set_exception(e)
        else:
            out.set_result(result)

    fut.add_done_callback(settle)
    return out


def all_works(works: list[dist.Work], value: Any) -> dist.Work:
    """One Work for several: done when all are, failing with the first failure."""
    return FutureWork(all_of([w.get_future() for w in works], value))


def all_of(futures: list[torch.futures.Future[Any]], value: Any) -> torch.futures.Future[Any]:
    """A future with `value` once all `futures` are done, failing with the
    first failure. It completes in the callback of the last one, on that
    callback's streams (CUDA: they waited for that future's events)."""
    out = future_for(value)
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
    return out


class P2PWork(dist.Work):
    """Gloo's send/recv work has no future: this one records a failure seen
    by wait(), and builds a future on demand from a helper thread."""

    def __init__(
        self,
        work: dist.Work,
        tensors: list[torch.Tensor],
        on_error: Any,
        after: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._work, self._tensors, self._on_error = work, tensors, on_error
        self._after = after
        """Run once after a successful wait (a staged result's copy back)."""
        self._future: torch.futures.Future[Any] | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            done = self._work.wait(timeout) if timeout else self._work.wait()
        except Exception as e:
            self._on_error(e)
            raise
        with self._lock:
            after, self._after = self._after, None
        if after is not None:
            after()
        return bool(done)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future[Any]:
        with self._lock:
            if self._future is None:
                self._future = future_for(self._tensors)
                threading.Thread(target=self._settle, name="torchft_gloo_p2p", daemon=True).start()
            return self._future

    def _settle(self) -> None:
        assert self._future is not None
        try:
            self.wait()
        except Exception as e:
            self._future.set_exception(e)
        else:
            self._future.set_result(self._tensors)


class HostStage:
    """CUDA tensors of a collective that gloo runs on host memory only (send,
    recv, the coalesced and reduce-scatter forms: gloo reads their data
    pointers as host memory): copied to host before it is issued, and the
    results back to the device after. gloo's allreduce, broadcast, allgather
    and alltoall take CUDA tensors themselves and are not staged."""

    def __init__(self) -> None:
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def host(self, tensor: torch.Tensor, result: bool = True) -> torch.Tensor:
        """`tensor` itself on the CPU; a host copy of a CUDA one (copied back
        after, if it is a `result`). The copy waits for the device."""
        if not tensor.is_cuda:
            return tensor
        copy = tensor.to("cpu")
        if result:
            self._back.append((tensor, copy))
        return copy

    @property
    def staged(self) -> bool:
        """Whether there is a result to copy back."""
        return bool(self._back)

    def hosts(self, tensors: list[torch.Tensor], result: bool = True) -> list[torch.Tensor]:
        return [self.host(t, result) for t in tensors]

    def copy_back(self) -> None:
        for tensor, copy in self._back:
            tensor.copy_(copy)
