"""ProcessGroupDummy: a process group that completes every collective at
once, without peers.

It absorbs what must not reach the other replica groups (torch DDP's
init-time broadcast) and stands in for a real group in tests.
"""

# torch's stubs declare ProcessGroup's methods as overloads of the bound C++
# methods, which a Python override cannot restate.

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchft_like._work import completed_work
from torchft_like.process_group.base import Registrable


class ProcessGroupDummy(Registrable, dist.ProcessGroup):  # type: ignore[misc]
    """Completes every collective at once without communicating.

    DDP is built over it so that its init-time parameter check and broadcast
    are absorbed: a replica can start while the others are mid-training.
    """

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        super().__init__(rank, world)
        self.num_ops = 0
        """Collectives absorbed so far (tests check DDP went through here)."""
        self.configure_count = 0
        """configure() calls so far (tests check a wrapper passed them on)."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Counts the call; a dummy group has no peers to meet."""
        self.configure_count += 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _done(self, value: Any) -> dist.Work:
        self.num_ops += 1
        return completed_work(value)

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._done(tensors)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._done(tensors)

    def broadcast(self, tensor_list: Any, opts: Any = None) -> dist.Work:
        return self._done(tensor_list)

    def allgather(self, output_tensors: Any, input_tensor: Any, opts: Any = None) -> dist.Work:
        for outputs, tensor in zip(output_tensors, input_tensor):
            for out in outputs:
                out.copy_(tensor)
        return self._done(output_tensors)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        output.copy_(
            input.reshape(-1).repeat(output.numel() // max(input.numel(), 1)).view_as(output)
        )
        return self._done(output)

    def allgather_into_tensor_coalesced(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        for out, tensor in zip(output_tensors, input_tensors):
            self._allgather_base(out, tensor)
        return self._done(output_tensors)

    def reduce_scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        for out, inputs in zip(output_tensors, input_tensors):
            out.copy_(inputs[0])
        return self._done(output_tensors)

    def reduce_scatter_tensor_coalesced(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        for out, tensor in zip(output_tensors, input_tensors):
            out.copy_(tensor.reshape(-1)[: out.numel()].view_as(out))
        return self._done(output_tensors)

    def alltoall_base(
        self,
        output_buffer: Any,
        input_buffer: Any,
        output_split: Any,
        input_split: Any,
        opts: Any = None,
    ) -> dist.Work:
        output_buffer.copy_(input_buffer)
        return self._done(output_buffer)

    def broadcast_one(self, tensor: Any, root: int) -> dist.Work:
        return self._done(tensor)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._done(None)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-dummy"
