"""Process groups for fault tolerance: reconfigurable, dummy and error-swallowing.

All are `torch.distributed.ProcessGroup` subclasses, so torch code (DDP
included) accepts them; torch dispatches their collectives to their Python
methods. One module per kind: `gloo` (the group rebuilt on every quorum, with
`gloo_work`), `nccl` (the same for NCCL, timed by `watchdog` under
`in_flight`'s rule), `baby` (gloo in a child process that abort kills) and
`baby_nccl` (NCCL there, tensors by CUDA IPC), `dummy`,
`wrappers` (delegating, error-swallowing, fake) and `managed` (the Manager's
allreduce as a group), over `base`.
"""

from __future__ import annotations

from typing import Any

from torchft_like.process_group.baby import ProcessGroupBabyGloo
from torchft_like.process_group.baby_nccl import ProcessGroupBabyNCCL
from torchft_like.process_group.base import SUPPORTED_OPS
from torchft_like.process_group.dummy import ProcessGroupDummy
from torchft_like.process_group.gloo import ProcessGroupGloo, parse_store_addr
from torchft_like.process_group.managed import ManagedProcessGroup
from torchft_like.process_group.nccl import ProcessGroupNCCL
from torchft_like.process_group.wrappers import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
)

# Importable from here, as torchft's ProcessGroupWrapper is from its module
# (the alias and the conformance shim map it), but not a star-import name.
from torchft_like.process_group.wrappers import _ProcessGroupWrapper as _ProcessGroupWrapper

__all__ = [
    "SUPPORTED_OPS",
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "parse_store_addr",
]


def __getattr__(name: str) -> Any:
    """torchft keeps `ft_init_device_mesh` here: it lives in
    torchft_like.device_mesh, imported on first use, so that importing the
    process groups does not import DeviceMesh. device_mesh imports only
    `process_group.managed`, never this package's namespace, so the two do
    not import each other even lazily."""
    if name == "ft_init_device_mesh":
        from torchft_like.device_mesh import ft_init_device_mesh

        return ft_init_device_mesh
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
