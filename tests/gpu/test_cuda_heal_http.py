"""Healing CUDA state over HTTP on one GPU: the source serves its CUDA
tensors through pinned host buffers after the stream that wrote them, and
the receiver puts every leaf the source held on CUDA onto its own device,
CPU leaves (the optimizer's step) on the CPU, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from tests.integration.test_http_transport import assert_identical, rich_state
from torchft_like.checkpointing.http_transport import HTTPTransport

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(120),
]
T = timedelta(seconds=30)
GPU = torch.device("cuda", 0)


def cuda_state() -> dict:
    """rich_state with its model and exp_avg on the GPU (one of them
    strided, one large enough for several slices); the step stays on the CPU."""
    state = rich_state()
    state["model"] = {k: v.to(GPU) for k, v in state["model"].items()}
    state["model"]["strided"] = torch.randn(4, 4, device=GPU).t()
    state["model"]["large"] = torch.randn(5_000_000, device=GPU)  # 20 MB: three 8 MB slices
    state["optim"]["state"][0]["exp_avg"] = state["optim"]["state"][0]["exp_avg"].to(GPU)
    return state


@pytest.fixture
def make() -> Iterator:
    made: list[HTTPTransport] = []

    def make(**kwargs) -> HTTPTransport:
        transport = HTTPTransport(timeout=T, hostname="127.0.0.1", **kwargs)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.shutdown()


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_cuda_state_arrives_on_the_receivers_gpu_bit_identical(make, num_chunks: int) -> None:
    state = cuda_state()
    source, receiver = make(), make(num_chunks=num_chunks, device=GPU)
    source.send_checkpoint([1], 5, state, T)
    got = receiver.recv_checkpoint(0, source.metadata(), 5, T)
    source.disallow_checkpoint()
    assert_identical(state, got)
    assert got["model"]["large"].device == GPU
    assert got["optim"]["state"][0]["step"].device.type == "cpu"


def test_a_receiver_on_the_cpu_gets_cpu_tensors_of_the_same_bytes(make) -> None:
    state = cuda_state()
    source, receiver = make(), make(device="cpu")
    source.send_checkpoint([1], 5, state, T)
    got = receiver.recv_checkpoint(0, source.metadata(), 5, T)
    source.disallow_checkpoint()
    on_cpu = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), state)
    assert_identical(on_cpu, got)


def test_a_striped_heal_of_cuda_state_lands_on_the_gpu(make) -> None:
    state = cuda_state()
    sources, receiver = [make(), make()], make(device=GPU)
    for s in sources:
        s.send_checkpoint([2], 9, state, T)
    got = receiver.recv_checkpoint_striped(
        [(0, sources[0].metadata()), (1, sources[1].metadata())], 9, T
    )
    for s in sources:
        s.disallow_checkpoint()
    assert_identical(state, got)
    assert set(receiver.last_stripe_report.bytes_by_source) != {0}


def test_the_source_serves_what_its_stream_wrote_before_staging(make) -> None:
    """Written on a user stream behind a long sleep kernel, then staged from
    that stream: the copies to host wait for the write (the ready event)."""
    state = {"w": torch.zeros(4_000_000, device=GPU)}
    stream = torch.cuda.Stream(GPU)
    source, receiver = make(), make(device=GPU)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time
        state["w"].fill_(7.0)
        source.send_checkpoint([1], 1, state, T)
    got = receiver.recv_checkpoint(0, source.metadata(), 1, T)
    source.disallow_checkpoint()
    assert bool((got["w"] == 7.0).all())
