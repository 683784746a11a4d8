"""Small CUDA stream helpers for code that must also run, unchanged and
without a CUDA call, on CPU tensors: a None stream means "no stream"."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn


def side_stream(module: nn.Module) -> Any:
    """A CUDA side stream on the device of `module`'s first CUDA parameter
    (of its local shard, for a DTensor); None, with no CUDA call, when none
    is on CUDA."""
    for p in module.parameters():
        local = p.data.to_local() if hasattr(p.data, "to_local") else p.data
        if local.is_cuda:
            with torch.cuda.device(local.device):
                return torch.cuda.Stream(device=local.device)
    return None


def on(stream: Any) -> AbstractContextManager[Any]:
    """`torch.cuda.stream(stream)`, or nothing for None."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)


def mark(stream: Any) -> Any:
    """An event recorded now on the CUDA `stream`."""
    event = torch.cuda.Event()
    event.record(stream)
    return event
