"""torch `Work` objects backed by a future, for collectives we complete ourselves."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class FutureWork(dist.Work):
    """A Work whose completion is a torch future (what DDP comm hooks return)."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


def cuda_devices(value: Any) -> list[int | str | torch.device]:
    """The CUDA devices of the tensors in `value` (nested lists, tuples, dicts)."""
    found: set[torch.device] = set()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_cuda:
                found.add(x.device)
        elif isinstance(x, (list, tuple)):
            for item in x:
                visit(item)
        elif isinstance(x, dict):
            for item in x.values():
                visit(item)

    visit(value)
    return sorted(found, key=str)


def future_for(value: Any) -> torch.futures.Future[Any]:
    """An unset future that will hold `value` (or tensors on its devices).

    CUDA-aware when `value` holds CUDA tensors: `set_result` then records an
    event on the setter's current streams, and a waiter's streams wait on it
    (what torch DDP expects of a comm hook's future), where a plain future
    would let the waiter read the tensors before the setter's kernels ran.
    """
    if isinstance(value, torch.Tensor):  # the per-bucket case, without a walk
        devices: list[int | str | torch.device] = [value.device] if value.is_cuda else []
    else:
        devices = cuda_devices(value)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def completed_future(value: Any) -> torch.futures.Future[Any]:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(value)
    return fut


def completed_work(value: Any) -> FutureWork:
    """Work that is already done with `value` (a no-op collective)."""
    return FutureWork(completed_future(value))


def or_default(
    fut: torch.futures.Future[Any],
    default: Any,
    on_error: Callable[[Exception], None],
    timeout: timedelta | None = None,
) -> torch.futures.Future[Any]:
    """A future with `fut`'s value, or `default` if `fut` fails (or, with
    `timeout`, is not done in time); the error goes to `on_error`. Settled
    once: a late value after the timeout is dropped. CUDA-aware on
    `default`'s devices (`future_for`)."""
    out = future_for(default)
    settled = threading.Lock()

    def settle(value: Any = None, error: Exception | None = None) -> None:
        if not settled.acquire(blocking=False):
            return
        if error is not None:
            on_error(error)
            value = default
        out.set_result(value)

    def done(f: torch.futures.Future[Any]) -> None:
        try:
            settle(f.value())
        except Exception as e:
            settle(error=e)

    if timeout is not None:
        timer = threading.Timer(
            timeout.total_seconds(),
            lambda: settle(error=TimeoutError(f"future not done within {timeout}")),
        )
        timer.name = "torchft_future_timeout"
        timer.daemon = True
        timer.start()
    fut.add_done_callback(done)
    return out
