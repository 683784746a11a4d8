"""torchft_like: per-step fault-tolerant data-parallel training for PyTorch."""

from importlib import metadata as _metadata

from torchft_like.data import DistributedSampler, StepBatches
from torchft_like.ddp import BufferSync, DistributedDataParallel, PureDistributedDataParallel
from torchft_like.manager import Manager, WorldSizeMode
from torchft_like.optim import Optimizer, OptimizerWrapper
from torchft_like.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)
from torchft_like.torchft_alias import install_as_torchft

try:
    # The distribution that ships both packages, torchft_like and lighthouse.
    __version__ = _metadata.version("torchft-like")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BufferSync",
    "DistributedDataParallel",
    "DistributedSampler",
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "Manager",
    "Optimizer",
    "OptimizerWrapper",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "PureDistributedDataParallel",
    "StepBatches",
    "WorldSizeMode",
    "__version__",
    "install_as_torchft",
]
