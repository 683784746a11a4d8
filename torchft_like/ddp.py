"""Fault-tolerant DistributedDataParallel: gradients travel through the Manager.

DDP is built over a ProcessGroupDummy, which absorbs its init-time parameter
check and broadcast, so a replica can be created while others are
mid-training (init_sync healing gives it the live weights instead). A comm
hook sends each gradient bucket through `Manager.allreduce`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.nn import parallel

from torchft_like.manager import Manager
from torchft_like.process_group import ProcessGroupDummy

_REFUSED_KWARGS = {
    "process_group": "gradients must go through the Manager, not a fixed process group",
    "device_mesh": "gradients must go through the Manager, not a fixed device mesh",
}
_DDP_PARAMS = inspect.signature(parallel.DistributedDataParallel).parameters
_HAS_BUCKET_CAP_LIST = "bucket_cap_mb_list" in _DDP_PARAMS
_BUFFER_FLAG = (
    "forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMS else "broadcast_buffers"
)


class BufferSync(Enum):
    """How a module buffer is kept identical across replicas each step."""

    BROADCAST = "broadcast"
    """Copied from the first replica at max step (DDP's broadcast_buffers)."""
    AVERAGE = "average"
    """Averaged over the participating replicas (e.g. running statistics)."""
    NONE = "none"
    """Left alone: each replica keeps its own (e.g. a local counter)."""


class _NoRebuildReducer:
    """Delegates to DDP's C++ Reducer but never rebuilds buckets.

    Why: DDP rebuilds its buckets after the first backward, in the order the
    gradients became ready. A replica that restarts mid-run would use the
    initial layout for its first step while the others use the rebuilt one,
    and the bucket allreduces would no longer match. torchft avoids the
    rebuild with find_unused_parameters=True, which walks the autograd graph
    on every step; refusing the rebuild here costs nothing per step. The
    initial layout (parameters in reverse order, a small first bucket, then
    `bucket_cap_mb` buckets) is then the layout of the whole run, on every
    replica.
    """

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


class _ManagerUsedMapGroup(ProcessGroupDummy):
    """The process group DDP is built over: absorbs everything, except that
    once attached to a Manager its allreduce goes through the Manager.

    Why: with find_unused_parameters or static_graph, DDP's reducer
    allreduces (SUM) a map of which parameters this rank used, over its own
    process group, to learn which were used by any rank. Over a plain dummy
    group a replica that skipped a branch would think it unused everywhere,
    leave its .grad untouched and diverge from a replica that used it. The
    reducer issues it each step after the last bucket's, in the same order on
    every replica, as the Manager needs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.manager: Manager | None = None
        """Set after DDP's construction, whose collectives stay absorbed."""

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if self.manager is None:
            return super().allreduce(tensors, opts)
        op = getattr(opts, "reduceOp", ReduceOp.SUM)
        if len(tensors) != 1 or op != ReduceOp.SUM:
            raise RuntimeError(
                f"fault-tolerant DDP routes only DDP's used-parameter map (one tensor, SUM) "
                f"through the Manager; got {len(tensors)} tensors, op {op}"
            )
        self.num_ops += 1
        return self.manager.allreduce(tensors[0], reduce_op=ReduceOp.SUM)


def _comm_hook(manager, bucket):
    # Unannotated on purpose: DDP compares the annotation with dist.GradBucket,
    # and this module's postponed annotations would be strings. In place: the
    # bucket is ours to drop after an abort (DistributedDataParallel.forward).
    return manager.allreduce(bucket.buffer(), in_place=True).get_future()


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch DDP whose gradient averaging goes through the Manager's quorum.

    Args:
        manager: this rank's Manager.
        module: the model, with all parameters on one device.
        buffer_sync: BufferSync for every buffer, or a mapping from buffer
            name (as in `module.named_buffers()`) to BufferSync; unnamed
            buffers default to BROADCAST.
        **kwargs: passed to torch DDP, except those that would break the
            fault-tolerance guarantees (process_group, device_mesh), which
            raise ValueError. find_unused_parameters and static_graph are
            taken: which parameters any replica used is agreed through the
            Manager, and the bucket layout stays fixed (see _NoRebuildReducer).
    """

    def __init__(
        self,
        manager: Manager,
        module: nn.Module,
        buffer_sync: BufferSync | Mapping[str, BufferSync] = BufferSync.BROADCAST,
        **kwargs: Any,
    ) -> None:
        for key, why in _REFUSED_KWARGS.items():
            if key in kwargs:
                raise ValueError(f"DistributedDataParallel does not take {key}: {why}")
        devices = {p.device for p in module.parameters()}
        if len(devices) > 1:
            raise ValueError(
                f"module has parameters on several devices {sorted(map(str, devices))}; "
                "fault-tolerant DDP needs a module on one device (move it with .to(device))"
            )
        # Buffers are synced by the Manager, not by DDP before each forward.
        kwargs.setdefault(_BUFFER_FLAG, False)
        # Gradients as views of the buckets: DDP then skips copying every
        # bucket back into .grad after the allreduce. With a comm hook DDP
        # cannot fuse the 1/N scaling into its copy into the bucket as plain
        # DDP does, so the Manager's divide is one more pass over the
        # gradients; skipping the copy back pays for it (bench/NOTES.md).
        kwargs.setdefault("gradient_as_bucket_view", True)
        if _HAS_BUCKET_CAP_LIST:
            # Layout = [1 MB first bucket, then bucket_cap_mb] in parameter order,
            # from the start (torch puts all in one bucket until its rebuild).
            cap = kwargs.pop("bucket_cap_mb", None) or 25
            kwargs.setdefault("bucket_cap_mb_list", [min(1, cap), cap])
        elif not kwargs.get("static_graph"):
            kwargs["find_unused_parameters"] = True  # older torch: no rebuild this way
        group = _ManagerUsedMapGroup()
        super().__init__(module, process_group=group, **kwargs)
        if kwargs.get("find_unused_parameters") and not kwargs.get("static_graph"):
            # static_graph instead allreduces the map only in a replica's
            # first step, which a restarted replica would take while the
            # others do not; its contract (the same parameters used on every
            # rank, every step) makes the local map the global one.
            group.manager = manager
        self.register_comm_hook(manager, _comm_hook)
        if _HAS_BUCKET_CAP_LIST:
            self.reducer = _NoRebuildReducer(self.reducer)
        self._manager = manager
        self._abandoned = manager.abandoned()
        self._buffer_groups = _group_buffers(module, buffer_sync)
        if self._buffer_groups:
            manager.register_commit_hook(self._sync_buffers_through_manager)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._manager.abandoned() != self._abandoned:
            self._fresh_buckets()
        return super().forward(*inputs, **kwargs)

    def _fresh_buckets(self) -> None:
        """A bucket allreduce was abandoned (a member gone): gloo may still
        write into that bucket, and the gradients are views of it. A new
        Reducer has new buckets; the gradients of the broken step, which did
        not commit, are dropped (None), so no step reads the old memory again.
        Reducing in the bucket (no private copy) is what pays for this rare
        rebuild: one pass over the gradients less per step (bench/NOTES.md)."""
        self._abandoned = self._manager.abandoned()
        logging.getLogger(__name__).info("new gradient buckets: an allreduce was abandoned")
        self.reducer._remove_autograd_hooks()
        parameters, expect_sparse = self._build_params_for_reducer()
        for param in parameters:
            param.grad = None
        names = self._build_debug_param_to_name_mapping(parameters)
        self._ddp_init_helper(parameters, expect_sparse, names, self.static_graph)
        if self.static_graph:
            self.reducer._set_static_graph()
            self.logger._set_static_graph()  # type: ignore[union-attr]
        for hook, state in self._comm_hooks:
            dist._register_comm_hook(self.reducer, state, hook)
        if _HAS_BUCKET_CAP_LIST:
            self.reducer = _NoRebuildReducer(self.reducer)

    def _sync_buffers_through_manager(self) -> None:
        """Runs in should_commit, after healing, so healed replicas match too."""
        source = self._manager.participating_rank() == 0
        for (policy, _dtype), buffers in self._buffer_groups.items():
            flat = torch.cat([b.detach().reshape(-1) for b in buffers])
            if policy == BufferSync.BROADCAST:
                if not source:
                    flat.zero_()
                work = self._manager.allreduce(flat, reduce_op=ReduceOp.SUM)
            else:
                work = self._manager.allreduce(flat, reduce_op=ReduceOp.AVG)
            work.wait()
            if self._manager.errored() is None:
                offset = 0
                with torch.no_grad():
                    for b in buffers:
                        b.copy_(flat[offset : offset + b.numel()].view_as(b))
                        offset += b.numel()


def _group_buffers(
    module: nn.Module, buffer_sync: BufferSync | Mapping[str, BufferSync]
) -> dict[tuple[BufferSync, torch.dtype], list[torch.Tensor]]:
    named = dict(module.named_buffers())
    if isinstance(buffer_sync, BufferSync):
        policies = {name: buffer_sync for name in named}
    else:
        unknown = sorted(set(buffer_sync) - set(named))
        if unknown:
            raise ValueError(f"buffer_sync names unknown buffers {unknown}; known: {sorted(named)}")
        policies = {name: buffer_sync.get(name, BufferSync.BROADCAST) for name in named}
    groups: dict[tuple[BufferSync, torch.dtype], list[torch.Tensor]] = {}
    for name, buf in named.items():
        policy = policies[name]
        if policy == BufferSync.NONE:
            continue
        if policy == BufferSync.AVERAGE and not buf.is_floating_point():
            raise ValueError(
                f"buffer {name} ({buf.dtype}) cannot be averaged; use BufferSync.BROADCAST or NONE"
            )
        groups.setdefault((policy, buf.dtype), []).append(buf)
    return groups


class PureDistributedDataParallel(nn.Module):
    """No reducer: one Manager allreduce per gradient, as soon as it is ready.

    For models torch DDP cannot wrap. Simpler and slower than
    DistributedDataParallel (no bucketing); the Manager waits for every
    allreduce before the commit vote.
    """

    def __init__(self, manager: Manager, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._manager = manager
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._allreduce_grad)

    def _allreduce_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._manager.allreduce(param.grad)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
