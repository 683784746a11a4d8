"""FT-HSDP's pieces on one GPU: the group's own process group is NCCL on
CUDA, FSDP2 shards a model on it, and an HSDPState shard healed over HTTP
lands on the GPU and loads bit for bit (a world of one rank: NCCL takes one
rank per GPU; across groups, over gloo-on-CUDA, is what
examples/train_fsdp.py --device cuda runs)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchft_like.checkpointing.http_transport import HTTPTransport
from torchft_like.hsdp import HSDPState, init_group_process_group

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(180),
]
T = timedelta(seconds=30)


def test_a_cuda_shard_heals_onto_the_gpu_of_an_nccl_group(monkeypatch) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tools.procs import free_port

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    device = init_group_process_group(timeout=T)
    try:
        assert device == torch.device("cuda", 0)
        assert dist.get_backend() == "nccl"
        mesh = init_device_mesh("cuda", (1,))

        def build() -> tuple[nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

        src_model, src_opt = build()
        for _ in range(3):
            src_opt.zero_grad()
            src_model(torch.randn(8, 16, device=device)).square().mean().backward()
            src_opt.step()
        dst_model, dst_opt = build()
        source, dest = HSDPState(src_model, src_opt), HSDPState(dst_model, dst_opt)
        a, b = HTTPTransport(T, hostname="127.0.0.1"), HTTPTransport(T, hostname="127.0.0.1")
        try:
            a.send_checkpoint([1], 3, source.state_dict(), T)
            got = b.recv_checkpoint(0, a.metadata(), 3, T)
            a.disallow_checkpoint()
        finally:
            a.shutdown()
            b.shutdown()
        assert all(v.to_local().is_cuda for v in got["model"].values())
        dest.load_state_dict(got)
        for (_, x), (_, y) in zip(
            src_model.state_dict().items(), dst_model.state_dict().items(), strict=True
        ):
            assert torch.equal(x.to_local(), y.to_local())
        for index, entry in src_opt.state_dict()["state"].items():
            for key, value in entry.items():
                theirs = dst_opt.state_dict()["state"][index][key]
                local = getattr(value, "to_local", lambda v=value: v)()
                assert torch.equal(local, getattr(theirs, "to_local", lambda t=theirs: t)()), key
    finally:
        dist.destroy_process_group()
