"""Durable checkpoints of CUDA state: saved through pinned host memory and
restored onto the GPU (CPU leaves on the CPU), or all on the CPU when asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.test_cuda_heal_http import cuda_state
from tests.integration.test_http_transport import assert_identical
from torchft_like.checkpointing import durable

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(120),
]


def test_cuda_state_restores_onto_the_gpu_bit_identical(tmp_path: Path) -> None:
    state = cuda_state()
    durable.save_state(state, tmp_path / "ckpt")
    got = durable.load_state(tmp_path / "ckpt", torch.device("cuda", 0))
    assert_identical(state, got)
    assert got["model"]["large"].is_cuda
    assert got["optim"]["state"][0]["step"].device.type == "cpu"


def test_cuda_state_restores_on_the_cpu_when_asked(tmp_path: Path) -> None:
    state = cuda_state()
    durable.save_state(state, tmp_path / "ckpt")
    got = durable.load_state(tmp_path / "ckpt", torch.device("cpu"))
    assert_identical(torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), state), got)


def test_saving_reads_what_the_stream_wrote(tmp_path: Path) -> None:
    """The pinned copies are ordered after the caller's stream, and waited for."""
    w = torch.zeros(4_000_000, device="cuda")
    torch.cuda._sleep(200_000_000)
    w.fill_(3.0)
    durable.save_state({"w": w}, tmp_path / "ckpt")
    got = durable.load_state(tmp_path / "ckpt")
    assert bool((got["w"] == 3.0).all()) and got["w"].is_cuda
