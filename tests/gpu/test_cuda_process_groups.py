"""The process groups on CUDA tensors (one GPU is enough): gloo on CUDA with
two ranks as threads (gloo, unlike NCCL, takes two ranks on one GPU), the
collectives gloo stages through host memory, the Manager's allreduce and
its quantized form, and the NCCL groups at world size 1, where the Baby
form's CUDA IPC staging and stream events run for real."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchft_like.collectives import InOrderCollectives
from torchft_like.process_group import (
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(120),
]

DEV = "cuda:0"


def slow_fill(t: torch.Tensor, value: float) -> None:
    """Writes `value` into `t` after ~50 ms of device time on the current
    stream: a reader that does not wait on the stream sees the old data."""
    torch.cuda._sleep(50_000_000)
    t.fill_(value)


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def on_all(members: Sequence[Any], fn: Callable[[int, Any], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(members)) as pool:
        return [f.result() for f in [pool.submit(fn, i, pg) for i, pg in enumerate(members)]]


def configure(store: dist.TCPStore, members: Sequence[Any], prefix: str) -> None:
    addr = f"127.0.0.1:{store.port}/{prefix}"
    on_all(members, lambda i, pg: pg.configure(addr, f"r{i}", i, len(members)))


@pytest.mark.parametrize("kind", [ProcessGroupGloo, ProcessGroupBabyGloo])
def test_gloo_groups_take_cuda_tensors(store, kind) -> None:
    members = [kind(timeout=timedelta(seconds=30)) for _ in range(2)]
    try:
        configure(store, members, "q/1")

        def body(rank: int, pg: Any) -> dict[str, torch.Tensor]:
            torch.cuda.set_device(0)
            t = torch.empty(1000, device=DEV)
            slow_fill(t, rank + 1.0)  # the collective must wait for it
            pg.allreduce([t], ReduceOp.AVG).wait()
            out = {"avg": t.clone()}
            got = [torch.empty(3, device=DEV) for _ in range(2)]
            pg.allgather([got], [torch.full((3,), float(rank), device=DEV)]).wait()
            out["gather"] = torch.stack(got)
            b = torch.full((4,), float(rank), device=DEV)
            pg.broadcast([b], 1).wait()
            out["bcast"] = b
            if kind is ProcessGroupGloo:  # staged through host memory
                x = torch.full((5,), float(rank), device=DEV)
                if rank == 0:
                    pg.send([torch.arange(5.0, device=DEV)], 1).wait()
                else:
                    pg.recv([x], 0).wait()
                out["p2p"] = x
                c = [torch.ones(2, device=DEV), torch.full((3,), 2.0, device=DEV)]
                pg.allreduce_coalesced(c).wait()
                out["coalesced"] = torch.cat(c)
            torch.cuda.synchronize()
            return out

        a, b = on_all(members, body)
        for r in (a, b):
            assert r["avg"].device.type == "cuda"
            assert torch.equal(r["avg"].cpu(), torch.full((1000,), 1.5))
            assert torch.equal(r["gather"].cpu(), torch.tensor([[0.0] * 3, [1.0] * 3]))
            assert torch.equal(r["bcast"].cpu(), torch.ones(4))
        if kind is ProcessGroupGloo:
            assert torch.equal(b["p2p"].cpu(), torch.arange(5.0))
            assert torch.equal(a["coalesced"].cpu(), torch.tensor([2.0, 2.0, 4.0, 4.0, 4.0]))
    finally:
        for pg in members:
            pg.shutdown()


@pytest.mark.parametrize("quantize", [False, True])
def test_manager_allreduce_on_cuda_waits_on_the_stream(store, quantize) -> None:
    members = [ProcessGroupGloo(timeout=timedelta(seconds=30)) for _ in range(2)]
    try:
        configure(store, members, "q/1")

        def body(rank: int, pg: Any) -> torch.Tensor:
            torch.cuda.set_device(0)
            collectives = InOrderCollectives()
            errors: list[Exception] = []
            t = torch.empty(4096, device=DEV)
            slow_fill(t, rank + 1.0)
            fut = collectives.allreduce(t, pg, quantize, 2, errors.append).get_future()
            value = fut.wait()  # a CUDA-aware future: this stream waits on it
            result = value.clone()
            torch.cuda.synchronize()
            assert not errors, errors
            return result.cpu()

        for r in on_all(members, body):
            assert torch.allclose(r, torch.full((4096,), 1.5), rtol=1e-2)
    finally:
        for pg in members:
            pg.shutdown()


@pytest.mark.parametrize("kind", ["nccl", "baby_nccl"])
def test_nccl_world_size_one_on_cuda(store, kind) -> None:
    torch.cuda.set_device(0)
    pg: Any = (
        ProcessGroupNCCL(timedelta(seconds=30))
        if kind == "nccl"
        else ProcessGroupBabyNCCL(timedelta(seconds=30))
    )
    try:
        for n in range(3):
            pg.configure(f"127.0.0.1:{store.port}/q/{n}", "r0", 0, 1)
            t = torch.empty(1 << 20, device=DEV)
            slow_fill(t, 2.0)  # the copy in (Baby) / the collective must wait for it
            pg.allreduce([t], ReduceOp.SUM).wait()
            u = t * 3  # on this stream, after the collective
            torch.cuda.synchronize()
            assert torch.equal(u.cpu(), torch.full((1 << 20,), 6.0))
            assert pg.errored() is None
            pg.abort(errored=False)
    finally:
        pg.shutdown()
