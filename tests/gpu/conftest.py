"""What the GPU checks share: the figures they report, the GPU count they
need, and the probes of a process's resources.

A test records a figure with `figure(name, value)`: pytest's record_property,
JSON-encoded, so that scripts/gpu_check.py reads it back from the JUnit XML
of the run (and prints it with -s when run by hand). A test that needs more
than one GPU calls `need_gpus(n)`, which skips with the reason the driver
gives for the same case."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def figure(record_property: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    def record(name: str, value: Any) -> None:
        record_property(name, json.dumps(value))
        print(f"figure {name} = {value}")

    return record


def need_gpus(n: int) -> None:
    """Skips the test, saying why, on a machine with fewer than `n` GPUs."""
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(
            f"needs {n} GPUs, this machine has {have}: NCCL refuses two ranks of one "
            "communicator on one GPU, so NCCL across replica groups needs a GPU per group"
        )


@pytest.fixture
def tcp_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def open_fds() -> int:
    """This process's open file descriptors (sockets and pipes among them)."""
    return len(os.listdir("/proc/self/fd"))


def device_used(device: int = 0) -> int:
    """Bytes in use on the whole GPU (every process's, NCCL's own buffers too)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def growth(samples: Sequence[float], window: int) -> float:
    """How much a resource grew over a loop: the least of its last `window`
    samples less the least of the first `window` ones. The least, not the
    mean: a process being torn down (a killed Baby child's context) briefly
    adds to a sample; only what stays raises the floor."""
    if len(samples) < 2 * window:
        raise ValueError(f"{len(samples)} samples, fewer than two windows of {window}")
    return min(samples[-window:]) - min(samples[:window])
