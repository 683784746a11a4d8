"""What every bench.goodput worker shares: the data set whose samples carry
their ids, the MLP, the epoch order the accounting reads positions from, a
JSON-lines log and a deadline.

The data set: NUM_SAMPLES random inputs labelled by a fixed random teacher
network (examples/train_ddp.py's task), as a TensorDataset of (id, x, y).
NUM_SAMPLES is a multiple of 3 groups x 32 samples, so neither a sharded
sampler (3 shards of whole batches) nor torchft_like's units drop a tail.

Every sampler of the benchmark (torch's DistributedSampler, torchft's and
torchft_like's, which subclass it) orders epoch e as
`torch.randperm(NUM_SAMPLES, generator=Generator().manual_seed(seed + e))`:
a 3-way shard takes every third sample of it, torchft_like's units are
consecutive slices of it. `epoch_positions` is that order, inverted.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

NUM_FEATURES, NUM_CLASSES = 64, 10
NUM_SAMPLES = 9216
"""96 x 96: a whole number of 3 x 32-sample steps."""


def dataset(seed: int) -> TensorDataset:
    """(id, x, y) for every sample; the same for every process of a run."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=gen)
    teacher = torch.randn(NUM_FEATURES, NUM_CLASSES, generator=gen)
    labels = (inputs @ teacher).argmax(dim=1)
    return TensorDataset(torch.arange(NUM_SAMPLES), inputs, labels)


def model(hidden: int, layers: int, seed: int) -> nn.Sequential:
    """The MLP every replica starts from (same weights in every process)."""
    torch.manual_seed(seed)
    parts: list[nn.Module] = [nn.Linear(NUM_FEATURES, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        parts += [nn.Linear(hidden, hidden), nn.ReLU()]
    parts.append(nn.Linear(hidden, NUM_CLASSES))
    return nn.Sequential(*parts)


def epoch_positions(seed: int, epoch: int) -> list[int]:
    """position[sample id] in epoch `epoch`'s order (see the module)."""
    order = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))
    positions = [0] * NUM_SAMPLES
    for position, sample in enumerate(order.tolist()):
        positions[sample] = position
    return positions


class JsonLog:
    """Appends one JSON object a line and flushes it: a SIGKILL loses at most
    the line being written (tools.procs.read_jsonl skips a cut one)."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a")

    def __call__(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
        self._file.flush()


def exit_at(deadline: float) -> None:
    """Ends this process at the wall-clock time `deadline` (Unix seconds),
    whatever it is doing: no worker outlives its run even if the harness dies."""
    timer = threading.Timer(max(deadline - time.time(), 0.0), os._exit, (3,))
    timer.daemon = True
    timer.start()
