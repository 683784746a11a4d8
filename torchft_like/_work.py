"""torch `Work` objects backed by a future, for collectives we complete ourselves."""

from __future__ import annotations

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


def completed_future(value: Any) -> torch.futures.Future[Any]:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(value)
    return fut


def completed_work(value: Any) -> FutureWork:
    """Work that is already done with `value` (a no-op collective)."""
    return FutureWork(completed_future(value))
