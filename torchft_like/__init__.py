"""torchft_like: per-step fault-tolerant data-parallel training for PyTorch."""

from torchft_like.data import DistributedSampler
from torchft_like.ddp import BufferSync, DistributedDataParallel, PureDistributedDataParallel
from torchft_like.manager import Manager, WorldSizeMode
from torchft_like.optim import Optimizer, OptimizerWrapper
from torchft_like.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
)
from torchft_like.step_batches import StepBatches
from torchft_like.torchft_alias import install_as_torchft

__all__ = [
    "BufferSync",
    "DistributedDataParallel",
    "DistributedSampler",
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "Manager",
    "Optimizer",
    "OptimizerWrapper",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "PureDistributedDataParallel",
    "StepBatches",
    "WorldSizeMode",
    "install_as_torchft",
]
