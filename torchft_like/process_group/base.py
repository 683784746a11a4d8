"""What every process group of the package shares: the ops it supports, the
ReduceOp of torch's option objects, and registration with torch by name.

Kept apart from the groups themselves so that gloo, the dummy and the managed
group can each be read (and imported) without the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed import ReduceOp

SUPPORTED_OPS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_into_tensor_coalesced",
    "alltoall_base",
    "broadcast",
    "broadcast_one",
    "barrier",
    "reduce_scatter",
    "reduce_scatter_tensor_coalesced",
    "send",
    "recv",
)


_WITH_REDUCE_OP = (dist.AllreduceOptions, dist.AllreduceCoalescedOptions, dist.ReduceScatterOptions)


def reduce_op(opts: Any) -> Any:
    """The ReduceOp of `opts`: None (SUM), a ReduceOp, or torch's options of
    an allreduce, a coalesced allreduce or a reduce-scatter."""
    if opts is None:
        return ReduceOp.SUM
    if isinstance(opts, _WITH_REDUCE_OP):
        return opts.reduceOp
    return opts


def with_reduce_op(options: Any, opts: Any) -> Any:
    """`options` (a fresh torch options object) with the ReduceOp of `opts`."""
    options.reduceOp = reduce_op(opts)
    return options


def broadcast_options(opts: Any) -> Any:
    """torch's BroadcastOptions from `opts`: themselves, a root rank, or None."""
    options = opts if isinstance(opts, dist.BroadcastOptions) else dist.BroadcastOptions()
    if isinstance(opts, int):
        options.rootRank = opts
    return options


def unsupported(name: str, supported: tuple[str, ...] = SUPPORTED_OPS) -> Callable[..., Any]:
    """A method that refuses `name`. NotImplementedError is a RuntimeError,
    and "does not support <op>" is what callers (torchft's tests among them)
    match to skip an op a backend lacks."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not support {name}; supported: {', '.join(supported)}"
        )

    return method


class Registrable:
    """`register(name)` / `unregister()`: makes a Python process group known
    to torch by name, which functional collectives (and DeviceMesh) need to
    find it from C++."""

    _registered_name: str | None = None
    _registered_desc: str = "undefined"

    def register(self, name: str) -> Any:
        """Registers this group under a new group name; returns self.

        The name is torch's next group number, as for any new group, so
        `dist.get_pg_count()` counts it. `name` is its description.
        """
        from torch.distributed import distributed_c10d as c10d

        group_name = str(c10d._world.group_count)
        c10d._world.group_count += 1
        self._registered_name = group_name
        self._registered_desc = name
        c10d._register_process_group(group_name, self)  # type: ignore[arg-type]
        return self

    # torch reads a group's name and description from its C++ backends,
    # which a Python process group has none of: answer them here.
    @property
    def group_name(self) -> str:
        if self._registered_name is None:
            raise RuntimeError(
                f"{type(self).__name__} has no group name: call register(name) first"
            )
        return self._registered_name

    @property
    def group_desc(self) -> str:
        return self._registered_desc

    def unregister(self) -> None:
        """Forgets the registration of `register()`; a no-op if there is none."""
        from torch.distributed import distributed_c10d as c10d

        name = getattr(self, "_registered_name", None)
        if name is not None:
            c10d._unregister_process_group(name)
            self._registered_name = None
