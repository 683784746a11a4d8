"""Healing CUDA state over the process group: over gloo on one GPU (two
ranks as threads; the transport stages CUDA leaves through host memory)
and over NCCL with two GPUs (device to device). Leaves the source held on
CUDA land on the receiver's device, CPU leaves on the CPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from tests.gpu.test_cuda_heal_http import cuda_state
from tests.integration.test_http_transport import assert_identical
from torchft_like.checkpointing.pg_transport import PGTransport, wire_device

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(180),
]
T = timedelta(seconds=60)


def heal(make_pg: Any, devices: list[torch.device]) -> tuple[dict, list[Any]]:
    """Rank 0 sends cuda_state() (on devices[0]) to rank 1, whose transport's
    device is devices[1]; returns the state sent and each rank's result."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with torch.cuda.device(devices[0]):
        state = cuda_state()
    state = torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(devices[0]) if t.is_cuda else t, state
    )

    def rank_main(rank: int) -> Any:
        torch.cuda.set_device(devices[rank])
        pg = make_pg()
        pg.configure(f"127.0.0.1:{store.port}/pg", "0", rank, 2)
        try:
            transport: PGTransport[Any] = PGTransport(pg, timeout=T, device=devices[rank])
            if rank == 0:
                transport.send_checkpoint([1], 3, state, T)
                return wire_device(pg, devices[0])
            return transport.recv_checkpoint(0, "<n/a>", 3, T)
        except Exception as e:
            return e
        finally:
            pg.shutdown()

    with ThreadPoolExecutor(2) as pool:
        return state, list(pool.map(rank_main, range(2)))


def test_cuda_state_heals_over_gloo_onto_the_gpu() -> None:
    from torchft_like.process_group import ProcessGroupGloo

    gpu = torch.device("cuda", 0)
    state, (wire, got) = heal(lambda: ProcessGroupGloo(timeout=T), [gpu, gpu])
    assert wire == torch.device("cpu")
    assert not isinstance(got, Exception), got
    assert_identical(state, got)
    assert got["optim"]["state"][0]["step"].device.type == "cpu"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs")
def test_cuda_state_heals_over_nccl_device_to_device() -> None:
    from torchft_like.process_group import ProcessGroupNCCL

    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    state, (wire, got) = heal(lambda: ProcessGroupNCCL(timeout=T), [a, b])
    assert wire == a
    assert not isinstance(got, Exception), got
    on_b = torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(b) if t.is_cuda else t, state
    )
    assert_identical(on_b, got)
    assert got["model"]["large"].device == b
    assert got["optim"]["state"][0]["step"].device.type == "cpu"
