"""Without faults, torchft_like DDP over 2 replica groups trains exactly like
plain torch DDP over 2 gloo ranks on the same data (over 3, within a few
ulps: the sums' order is gloo's), also with
find_unused_parameters (a branch some ranks skip on some steps) and
static_graph (a branch never used).

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


class Branchy(nn.Module):
    """A trunk, a branch used only when asked, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.trunk(x).relu()
        if use_branch:
            h = h + self.branch(h).relu()
        return self.head(h)


BRANCHY = Branchy()
FLAGS = {
    "plain": {},
    "find_unused": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
}


def uses_branch(mode: str, rank: int, step: int) -> bool:
    """find_unused: both ranks, rank 0 only, neither, rank 1 only, in turn."""
    if mode == "static_graph":
        return False
    return (step + rank) % 4 in (0, 1)


def forward(ddp: nn.Module, mode: str, rank: int, step: int, x: torch.Tensor) -> torch.Tensor:
    return ddp(x) if mode == "plain" else ddp(x, use_branch=uses_branch(mode, rank, step))


def model_and_optimizer(mode: str = "plain"):
    # Copies of one template: seeding the global RNG in threads would race.
    model = copy.deepcopy(TEMPLATE if mode == "plain" else BRANCHY)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def plain_ddp(rank: int, world_size: int, port: int, out: str, mode: str) -> None:
    """One rank of plain torch DDP; saves its final parameters to `out`."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=T
    )
    model, optimizer = model_and_optimizer(mode)
    ddp = nn.parallel.DistributedDataParallel(model, **FLAGS[mode])
    for step in range(STEPS):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(forward(ddp, mode, rank, step, x), y).backward()
        optimizer.step()
    torch.save([p.detach() for p in model.parameters()], out)
    del ddp
    dist.destroy_process_group()


def torchft_ddp(rank: int, groups: int, lighthouse: str, mode: str) -> list[torch.Tensor]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model, inner = model_and_optimizer(mode)
    manager = small_replica(
        rank, 0, 1, store, lighthouse, model, inner,
        min_replica_size=groups, timeout=T, connect_timeout=T,
    )  # fmt: skip
    ddp = DistributedDataParallel(manager, model, **FLAGS[mode])
    optimizer = Optimizer(manager, inner)
    try:
        while manager.current_step() < STEPS:
            # Replica rank == group index here: ids sort as group0 < group1.
            step = manager.current_step()
            x, y = batch(rank, step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(forward(ddp, mode, rank, step, x), y).backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        manager.shutdown()


def run_both(
    children, tmp_path, mode: str, groups: int = 2
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Plain torch DDP's final parameters (rank 0) over `groups` ranks, and
    ours per group over as many replica groups of one rank."""
    port = free_port()
    ranks = [
        children.spawn(
            [
                sys.executable,
                "-m",
                "tests.integration.test_ddp_equivalence",
                str(rank),
                str(groups),
                str(port),
                str(tmp_path / f"plain{rank}.pt"),
                mode,
            ],
            log=tmp_path / f"plain{rank}.log",
        )  # fmt: skip
        for rank in range(groups)
    ]
    for rank, proc in enumerate(ranks):
        assert proc.wait(timeout=60) == 0, (tmp_path / f"plain{rank}.log").read_text()[-3000:]
    plain = torch.load(tmp_path / "plain0.pt")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=groups)
    try:
        with ThreadPoolExecutor(groups) as pool:
            ours = list(
                pool.map(
                    torchft_ddp,
                    range(groups),
                    [groups] * groups,
                    [lighthouse.address()] * groups,
                    [mode] * groups,
                )  # fmt: skip
            )
    finally:
        lighthouse.shutdown()
    return plain, ours


def test_two_replica_groups_are_bit_identical_to_plain_torch_ddp_after_20_steps(children, tmp_path):
    plain, ours = run_both(children, tmp_path, "plain")
    for a, b, c in zip(plain, ours[0], ours[1]):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_three_replica_groups_match_plain_torch_ddp_and_each_other_after_20_steps(
    children, tmp_path
):
    """Three ranks sum in an order of gloo's: ours and torch DDP's land
    within a few float32 ulps (measured: at most 6e-8), not bit for bit."""
    plain, ours = run_both(children, tmp_path, "plain", groups=3)
    for a, b in zip(plain, ours[0]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for other in ours[1:]:
        for a, b in zip(ours[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["find_unused", "static_graph"])
def test_with_unused_parameters_ours_is_bit_identical_to_torch_ddp_with_the_same_flag(
    children, tmp_path, mode
):
    plain, ours = run_both(children, tmp_path, mode)
    initial = list(BRANCHY.parameters())
    for name, a, b, c, init in zip(
        [n for n, _ in BRANCHY.named_parameters()], plain, ours[0], ours[1], initial
    ):
        assert torch.equal(a, b) and torch.equal(b, c), name
        # The branch trains only where some rank used it.
        assert torch.equal(a, init) == (mode == "static_graph" and name.startswith("branch")), name


if __name__ == "__main__":
    plain_ddp(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    # Skip interpreter finalization, where gloo's threads sometimes abort a
    # plain torch DDP process that is done (as in bench/_step_worker.py).
    sys.stdout.flush()
    os._exit(0)
