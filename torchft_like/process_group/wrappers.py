"""Process groups that wrap another: the plain delegating wrapper, the one
that turns a collective's failure into a recorded error, and the one that
injects failures for tests.

Apart from the groups they wrap, because they wrap any of them (gloo, the
dummy, a user's own).
"""

# torch's stubs declare ProcessGroup's methods as overloads of the bound C++
# methods, which a Python override cannot restate.

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchft_like._work import FutureWork, completed_work

logger = logging.getLogger(__name__)


class _ProcessGroupWrapper(dist.ProcessGroup):
    """Delegates every supported collective to `pg` through `_dispatch`."""

    def __init__(self, pg: Any) -> None:
        super().__init__(0, 1)
        self._pg = pg

    @property
    def parent(self) -> Any:
        return self._pg

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self._pg.configure(store_addr, replica_id, rank, world_size)

    def __repr__(self) -> str:
        # torchft's name for the plain wrapper, whose subclasses say their own.
        name = "ProcessGroupWrapper" if type(self) is _ProcessGroupWrapper else type(self).__name__
        return f"{name}(pg={self._pg!r})"

    def _dispatch(self, start: Callable[[], dist.Work], default: Any) -> dist.Work:
        return start()

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._dispatch(lambda: self._pg.allreduce_coalesced(tensors, opts), tensors)

    def allgather_into_tensor_coalesced(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.allgather_into_tensor_coalesced(output_tensors, input_tensors, opts),
            output_tensors,
        )

    def reduce_scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.reduce_scatter(output_tensors, input_tensors, opts), output_tensors
        )

    def reduce_scatter_tensor_coalesced(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, opts),
            output_tensors,
        )

    def alltoall_base(
        self,
        output_buffer: Any,
        input_buffer: Any,
        output_split: Any,
        input_split: Any,
        opts: Any = None,
    ) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.alltoall_base(
                output_buffer, input_buffer, output_split, input_split, opts
            ),
            output_buffer,
        )

    def broadcast_one(self, tensor: Any, root: int) -> dist.Work:
        return self._dispatch(lambda: self._pg.broadcast_one(tensor, root), tensor)

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._dispatch(lambda: self._pg.allreduce(tensors, opts), tensors)

    def allgather(self, output_tensors: Any, input_tensor: Any, opts: Any = None) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.allgather(output_tensors, input_tensor, opts), output_tensors
        )

    def broadcast(self, tensor_list: Any, opts: Any = None) -> dist.Work:
        return self._dispatch(lambda: self._pg.broadcast(tensor_list, opts), tensor_list)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._dispatch(lambda: self._pg.barrier(opts), None)

    def send(self, tensors: Any, dst_rank: int, tag: int = 0) -> dist.Work:
        return self._dispatch(lambda: self._pg.send(tensors, dst_rank, tag), tensors)

    def recv(self, tensors: Any, src_rank: int, tag: int = 0) -> dist.Work:
        return self._dispatch(lambda: self._pg.recv(tensors, src_rank, tag), tensors)

    def errored(self) -> Exception | None:
        return self._pg.errored() if hasattr(self._pg, "errored") else None

    def size(self) -> int:
        return self._pg.size()

    def rank(self) -> int:
        return self._pg.rank()

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self._pg.getBackendName()

    def shutdown(self) -> None:
        if hasattr(self._pg, "shutdown"):
            self._pg.shutdown()


class ErrorSwallowingProcessGroupWrapper(_ProcessGroupWrapper):
    """Turns collective errors into a recorded error and completed work.

    The training loop never sees an exception from a peer's death; after the
    first error the collectives are no-ops until `configure()` is called.
    """

    def __init__(self, pg: Any) -> None:
        super().__init__(pg)
        self._error: Exception | None = None

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self._error = None
        super().configure(store_addr, replica_id, rank, world_size)

    def report_error(self, e: Exception) -> None:
        if self._error is None:
            logger.warning(
                "collective failed, later collectives are no-ops until reconfigured: %s", e
            )
            self._error = e

    def error(self) -> Exception | None:
        return self._error

    def errored(self) -> Exception | None:
        return self._error or super().errored()

    def _dispatch(self, start: Callable[[], dist.Work], default: Any) -> dist.Work:
        if self._error is not None:
            return completed_work(default)
        try:
            work = start()
        except Exception as e:
            self.report_error(e)
            return completed_work(default)
        out: torch.futures.Future[Any] = torch.futures.Future()

        def settle(fut: torch.futures.Future[Any]) -> None:
            try:
                out.set_result(fut.value())
            except Exception as e:
                self.report_error(e)
                out.set_result(default)

        work.get_future().add_done_callback(settle)
        return FutureWork(out)


class FakeProcessGroupWrapper(_ProcessGroupWrapper):
    """Injects failures on demand, for tests of the failure paths."""

    def __init__(self, pg: Any) -> None:
        super().__init__(pg)
        self._raise_next: Exception | None = None
        self._future_error: Exception | None = None

    def fail_next_collective(self, e: Exception) -> None:
        """The next collective raises `e` when called."""
        self._raise_next = e

    def report_future_error(self, e: Exception) -> None:
        """The next collective's future completes with `e`."""
        self._future_error = e

    def _dispatch(self, start: Callable[[], dist.Work], default: Any) -> dist.Work:
        if self._raise_next is not None:
            e, self._raise_next = self._raise_next, None
            raise e
        work = start()
        if self._future_error is None:
            return work
        e, self._future_error = self._future_error, None
        failed: torch.futures.Future[Any] = torch.futures.Future()
        work.get_future().add_done_callback(lambda _: failed.set_exception(e))
        return FutureWork(failed)
