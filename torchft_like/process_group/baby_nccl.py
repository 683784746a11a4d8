"""ProcessGroupBabyNCCL: NCCL in a child process that abort() kills.

The child, its warm standby and its protocol are ProcessGroupBabyGloo's
(baby.py); what NCCL changes:

- Tensors cross by CUDA IPC, device to device, never through the host:
  staging buffers on the caller's GPU, shared once with each child
  (`DeviceStaging`). The caller's stream copies in and records an
  interprocess event; the child's stream waits for it, runs the collective,
  and records one the parent's stream waits for before copying out. No
  host thread waits for the device on the way.
- The buffers belong to the process group, not to a child: torch keeps a
  CUDA IPC buffer alive until its receiver lets it go, which a killed child
  never does, so buffers per child would leak on every abort.
- NCCL in the child does not time out by itself in time: the parent's
  watchdog (watchdog.py) times each collective until its device event
  completed, and kills the child at the first overdue one.
- `errored()` waits for the collectives in flight to finish on the device,
  as ProcessGroupNCCL's does.

`child_backend="gloo"` runs gloo in the child instead (CPU tensors, host
buffers): what the tests drive on a machine without a GPU.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from torchft_like.process_group.baby import Buffers, Child, Op, ProcessGroupBabyGloo
from torchft_like.process_group.in_flight import Issued
from torchft_like.process_group.nccl import require_nccl
from torchft_like.process_group.watchdog import Watchdog

logger = logging.getLogger(__name__)


class DeviceStaging:
    """CUDA staging buffers, reused by (device, size) and shared with each
    child by CUDA IPC once. A buffer given back carries the event after
    which it may be written again; `take` makes the caller's stream wait
    for it. `take` runs under the child's send lock (it may send a buffer);
    its own lock covers `give_back` from a reader or a reaper."""

    def __init__(self) -> None:
        import torch.multiprocessing  # noqa: F401 (CUDA IPC pickling of tensors and events)

        self._lock = threading.Lock()
        self._tensors: dict[int, torch.Tensor] = {}
        self._free: dict[tuple[torch.device, int], list[int]] = {}
        self._reusable_after: dict[int, Any] = {}
        self._shared_with: dict[int, Child] = {}

    def take(self, nbytes: int, device: torch.device, child: Child) -> tuple[int, torch.Tensor]:
        with self._lock:
            free = self._free.get((device, nbytes))
            if free:
                buf_id = free.pop()
            else:
                buf_id = len(self._tensors)
                self._tensors[buf_id] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            after = self._reusable_after.pop(buf_id, None)
            tensor = self._tensors[buf_id]
            shared = self._shared_with.get(buf_id) is child
            self._shared_with[buf_id] = child
        if after is not None:
            torch.cuda.current_stream(device).wait_event(after)
        if not shared:
            child.conn.send(("map_cuda", buf_id, tensor))
        return buf_id, tensor

    def give_back(self, buf_id: int, reusable_after: Any = None) -> None:
        with self._lock:
            tensor = self._tensors[buf_id]
            if reusable_after is not None:
                self._reusable_after[buf_id] = reusable_after
            self._free.setdefault((tensor.device, tensor.numel()), []).append(buf_id)


class ProcessGroupBabyNCCL(ProcessGroupBabyGloo):
    """NCCL in a child process, rebuilt on every configure; `abort()` kills it.

    Uses the current CUDA device at configure (call
    `torch.cuda.set_device(local_rank)` first). Its works complete on the
    stream: a waiter's stream waits for the collective, its host does not.

    Args:
        timeout: bound on configure and on every collective.
        child_backend: "nccl"; "gloo" stands in for it in tests on CPU.
        standby: keep a child started for the next configure.

    Raises:
        RuntimeError: (at construction, for "nccl") no CUDA or no NCCL on
            this machine, in one line.
    """

    def __init__(
        self,
        timeout: timedelta | float = timedelta(seconds=60),
        *,
        child_backend: str = "nccl",
        standby: bool = True,
    ) -> None:
        if child_backend not in ("nccl", "gloo"):
            raise ValueError(
                f"child_backend is 'nccl' or 'gloo' (a stand-in), not {child_backend!r}"
            )
        if child_backend == "nccl":
            require_nccl(type(self).__name__)
        super().__init__(timeout, standby=standby)
        self._backend_kind = child_backend
        self._staging: DeviceStaging | None = None
        self._watchdog = Watchdog("torchft_baby_nccl_watchdog", self._overdue)
        self._generation = 0

    def _child_backend(self) -> tuple[str, int | None]:
        if self._backend_kind == "gloo":
            return ("gloo", None)
        return ("nccl", torch.cuda.current_device())

    def _child_timeout_s(self) -> float:
        # Past ours: the watchdog kills the child first, with our error.
        return self._timeout_s * 2 + 30

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self._generation += 1
        self._watchdog.clear()
        super().configure(store_addr, replica_id, rank, world_size)

    def _stage(self, x: torch.Tensor, op: Op, buffers: Buffers, child: Child) -> Any:
        if not x.is_cuda:
            return super()._stage(x, op, buffers, child)
        if self._staging is None:
            self._staging = DeviceStaging()
        nbytes = x.numel() * x.element_size()
        buf_id, buf = self._staging.take(nbytes, x.device, child)
        view = buf[:nbytes].view(x.dtype).view(x.shape)
        view.copy_(x)  # on the caller's stream
        op.staged.append((x, view))
        op.device_buf_ids.append(buf_id)
        return ("C", buf_id, str(x.dtype).removeprefix("torch."), tuple(x.shape))

    def _issued(self, op: Op) -> Any:
        if not op.device_buf_ids:
            return None
        ready = torch.cuda.Event(interprocess=True)
        ready.record()  # after the copies in, on the caller's stream
        return ready

    def _before_copy_back(self, op: Op, done: Any) -> None:
        if done is not None:
            torch.cuda.current_stream(op.staged[0][0].device).wait_event(done)
            op.device_done = done

    def _give_back(self, op: Op, buffers: Buffers, child: Child) -> None:
        super()._give_back(op, buffers, child)
        if not op.device_buf_ids or self._staging is None:
            return
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(op.staged[0][0].device))  # after the copies out
        for buf_id in op.device_buf_ids:
            self._staging.give_back(buf_id, copied)

    def _forget(self, op: Op) -> None:
        # Its child is dead: nothing writes into its buffers any more, and
        # the caller's stream orders its own copies in.
        if self._staging is not None:
            for buf_id in op.device_buf_ids:
                self._staging.give_back(buf_id)

    def _watch(self, op: Op) -> None:
        def finished() -> bool:
            done = op.device_done
            return op.future.done() and (done is None or bool(done.query()))

        deadline = time.monotonic() + self._timeout_s
        self._watchdog.add(Issued("collective", deadline, finished, self._generation))

    def _overdue(self, issued: Issued) -> None:
        if issued.generation != self._generation:
            return
        logger.error("a collective did not finish within %s s: killing the child", self._timeout_s)
        error = TimeoutError(
            f"a collective did not finish within {self._timeout_s:g} s; "
            f"{type(self).__name__} killed its child process"
        )
        with self._lock:
            self._error = self._error or error
        self._drop_child(error, wait=False)

    def abort(self, errored: bool = True) -> None:
        self._watchdog.clear()
        super().abort(errored)

    def shutdown(self) -> None:
        self._watchdog.close()
        super().shutdown()

    def errored(self) -> Exception | None:
        """The failure since the last configure(), once the collectives in
        flight finished on the device (bounded: the watchdog kills past it)."""
        self._watchdog.wait_idle(lambda: self._error is not None)
        return self._error

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-baby-nccl"
