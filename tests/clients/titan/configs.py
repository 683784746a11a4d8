"""torchtitan configs for the integration suite: its llama3 fault-tolerance
recipe, shrunk to run on two CPU cores, in each fault-tolerance mode it has.

Used as `--module configs --config <name>` by launch.py. The recipe itself
(model, FT trainer, FT checkpointer, FT optimizer) is torchtitan's; only what
a CPU test needs changes: the attention kernel (causal SDPA: flex attention
has no backward on CPU, and one document per sample needs no mask), float32, no
profiler, a short sequence, and synthetic tokens instead of a tokenizer and a
dataset on disk (none ship with torchtitan's wheel).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.validate import Validator
from torchtitan.config import CommConfig, TrainingConfig
from torchtitan.experiments.torchft.llama3.config_registry import (
    llama3_torchft_debugmodel,
)
from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.tools.profiler import Profiler

VOCAB = 2048  # the debug model's vocabulary


class Tokens(IterableDataset, torch.distributed.checkpoint.stateful.Stateful):
    """Sample i of data-parallel rank r is a fixed function of (r, i), so a
    replica group's data is the same whichever process trains it, and the
    position is part of the dataloader state torchtitan checkpoints."""

    def __init__(self, dp_rank: int, seq_len: int) -> None:
        self.dp_rank, self.seq_len, self.index = dp_rank, seq_len, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(self.dp_rank * 1_000_003 + self.index)
            self.index += 1
            # A learnable sequence: a random start, then +1 per token.
            start = int(torch.randint(VOCAB, (1,), generator=g))
            seq = (start + torch.arange(self.seq_len + 1)) % VOCAB
            yield {"input": seq[:-1]}, seq[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.index = state_dict["index"]


class SyntheticDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        pass

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: object,
        seq_len: int,
        local_batch_size: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            Tokens(dp_rank, seq_len),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
        )


def _cpu(semi_sync_method: str | None) -> FaultTolerantTrainer.Config:
    config = llama3_torchft_debugmodel()
    model = config.model_spec.model
    for _, _, parent, key in list(model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[key] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, key, ScaledDotProductAttention.Config())
    config.tokenizer = None
    config.dataloader = SyntheticDataLoader.Config()
    config.profiler = Profiler.Config(enable_profiling=False)
    config.metrics = MetricsProcessor.Config(log_freq=1)
    config.validator = Validator.Config(enable=False)
    config.activation_checkpoint = None
    config.training = TrainingConfig(
        local_batch_size=2,
        seq_len=64,
        steps=30,
        mixed_precision_param="float32",
    )
    config.comm = CommConfig(init_timeout_seconds=60, train_timeout_seconds=30)
    # One initial model in every run, so runs with and without a kill differ
    # only by the kill (unseeded, step 1's loss alone varied by 0.25).
    config.debug = replace(config.debug, seed=0)
    config.checkpoint = replace(config.checkpoint, enable=True, interval=1000)
    config.fault_tolerance = replace(
        config.fault_tolerance,
        process_group="gloo",
        semi_sync_method=semi_sync_method,
        sync_steps=5,
        num_fragments=2,
    )
    return config


def ft_replicas() -> FaultTolerantTrainer.Config:
    """Replica groups with the asynchronous quorum: each step's gradients are
    averaged across groups by torchtitan's FSDP all-reduce hook."""
    return _cpu(None)


def ft_hsdp() -> FaultTolerantTrainer.Config:
    """HSDP: FSDP2 across a group's ranks, replica groups across groups.
    torchtitan's classic DTensor path (its default "spmd_types" leaves the
    parameters plain tensors that FSDP then refuses on a 2-rank group)."""
    config = _cpu(None)
    config.parallelism = replace(config.parallelism, spmd_backend="partial_dtensor")
    return config


def ft_local_sgd() -> FaultTolerantTrainer.Config:
    """LocalSGD: the synchronous quorum every `sync_steps`."""
    return _cpu("local_sgd")


def ft_diloco() -> FaultTolerantTrainer.Config:
    """Streaming DiLoCo in two fragments, the synchronous quorum (a sync every
    4 steps: a multiple of the fragment count)."""
    config = _cpu("diloco")
    config.fault_tolerance.sync_steps = 4
    return config
