"""ManagedProcessGroup: a process group whose allreduce is the Manager's.

Its own module, so that torchft_like.device_mesh (FT-HSDP's mesh, built on
it) imports just this, while the package re-exports the mesh function
(torchft's path) lazily: neither imports the other back.
"""

# torch's stubs declare ProcessGroup's methods as overloads of the bound C++
# methods, which a Python override cannot restate.

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchft_like.process_group.base import Registrable, reduce_op, unsupported


class ManagedProcessGroup(Registrable, dist.ProcessGroup):  # type: ignore[misc]
    """A process group whose allreduce goes through `manager.allreduce`, for
    libraries that want a process group; its size is the quorum's.

    FT-HSDP uses it as the replicate dimension of FSDP2's mesh
    (`register("dp_replicate")`, then `torchft_like.device_mesh`): FSDP2's
    gradient all-reduce over that dimension (SUM or AVG) is then averaged
    over the live replica groups by the Manager.
    """

    def __init__(self, manager: Any) -> None:
        super().__init__(0, 1)
        self._manager = manager

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        if len(tensors) != 1:
            raise ValueError(f"ManagedProcessGroup.allreduce takes one tensor, got {len(tensors)}")
        # The Manager's own work, as it is: wrapping it would add a future
        # that only settles through the Manager's, so whatever holds the
        # Manager's up (or a Manager double whose work never completes)
        # would hang every wait() on ours. Its future holds the tensor.
        return self._manager.allreduce(tensors[0], reduce_op=reduce_op(opts))

    allreduce_coalesced = unsupported("allreduce_coalesced", ("allreduce",))
    allgather = unsupported("allgather", ("allreduce",))
    allgather_into_tensor_coalesced = unsupported("allgather_into_tensor_coalesced", ("allreduce",))
    alltoall_base = unsupported("alltoall_base", ("allreduce",))
    broadcast = unsupported("broadcast", ("allreduce",))
    broadcast_one = unsupported("broadcast_one", ("allreduce",))
    barrier = unsupported("barrier", ("allreduce",))
    reduce_scatter = unsupported("reduce_scatter", ("allreduce",))
    reduce_scatter_tensor_coalesced = unsupported("reduce_scatter_tensor_coalesced", ("allreduce",))

    def _before_first_quorum(self) -> bool:
        # FSDP2 reads rank() when fully_shard() builds the model, before the
        # training loop asks for the first quorum (the Manager's would then
        # fail: "call start_quorum() first"). Until then this group is alone.
        # A Manager double without the attribute counts as having a quorum.
        return getattr(self._manager, "_quorum_future", True) is None

    def size(self) -> int:
        if self._before_first_quorum():
            return 1
        return self._manager.num_participants()

    def rank(self) -> int:
        if self._before_first_quorum():
            return 0
        return self._manager.participating_rank() or 0

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-managed"
