"""Without faults, torchft_like DDP over 2 replica groups trains exactly like
plain torch DDP over 2 gloo ranks on the same data.

Plain DDP runs in two processes (this module, run as a script): two DDP ranks
as threads of one process sometimes deadlocked in backward, and a hung thread
would hang the whole suite past any test timeout."""

from __future__ import annotations

import copy
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from tests.integration._replica import small_replica
from tools.procs import free_port
from torchft_like import DistributedDataParallel, Optimizer

pytestmark = pytest.mark.timeout(90)
STEPS = 20
T = timedelta(seconds=10)


torch.manual_seed(0)
TEMPLATE = nn.Sequential(
    nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
)


def model_and_optimizer():
    # Copies of one template: seeding the global RNG in threads would race.
    model = copy.deepcopy(TEMPLATE)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def plain_ddp(rank: int, port: int, out: str) -> None:
    """One rank of plain torch DDP; saves its final parameters to `out`."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=T
    )
    model, optimizer = model_and_optimizer()
    ddp = nn.parallel.DistributedDataParallel(model)
    for step in range(STEPS):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    torch.save([p.detach() for p in model.parameters()], out)
    del ddp
    dist.destroy_process_group()


def torchft_ddp(rank: int, lighthouse: str) -> list[torch.Tensor]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model, inner = model_and_optimizer()
    manager = small_replica(
        rank, 0, 1, store, lighthouse, model, inner,
        min_replica_size=2, timeout=T, connect_timeout=T,
    )  # fmt: skip
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    try:
        while manager.current_step() < STEPS:
            # Replica rank == group index here: ids sort as group0 < group1.
            x, y = batch(rank, manager.current_step())
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        manager.shutdown()


def test_two_replica_groups_match_plain_torch_ddp_after_20_steps(children, tmp_path):
    port = free_port()
    ranks = [
        children.spawn(
            [
                sys.executable,
                "-m",
                "tests.integration.test_ddp_equivalence",
                str(rank),
                str(port),
                str(tmp_path / f"plain{rank}.pt"),
            ],
            log=tmp_path / f"plain{rank}.log",
        )  # fmt: skip
        for rank in range(2)
    ]
    for rank, proc in enumerate(ranks):
        assert proc.wait(timeout=60) == 0, (tmp_path / f"plain{rank}.log").read_text()[-3000:]
    plain = [torch.load(tmp_path / "plain0.pt")]
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            ours = list(pool.map(torchft_ddp, range(2), [lighthouse.address()] * 2))
    finally:
        lighthouse.shutdown()
    for a, b in zip(plain[0], ours[0]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for a, b in zip(ours[0], ours[1]):
        assert torch.equal(a, b)


if __name__ == "__main__":
    plain_ddp(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    # Skip interpreter finalization, where gloo's threads sometimes abort a
    # plain torch DDP process that is done (as in bench/_step_worker.py).
    sys.stdout.flush()
    os._exit(0)
