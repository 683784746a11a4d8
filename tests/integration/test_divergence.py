"""Divergence detection with a real lighthouse, real gloo and real HTTP
healing: replica groups are threads; one replica's weights are corrupted
after a commit and the next fingerprint step must find and heal it."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from tests.integration._replica import small_replica
from torchft_like import Optimizer

pytestmark = pytest.mark.timeout(90)
TIMEOUT = timedelta(seconds=10)
STEPS = 8
INTERVAL = 2


def train(
    lighthouse_addr: str,
    group: int,
    num_groups: int,
    group_world_size: int,
    interval: int,
    corrupt: set[tuple[int, int, int]],
    params_only: bool = False,
) -> list[dict]:
    """One replica group of `group_world_size` rank threads. After the
    commit that reaches step s, rank r adds 1e-3 to one weight if
    (group, r, s) is in `corrupt`. Returns each rank's final state."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def rank_main(rank: int) -> dict:
        torch.manual_seed(100 + group)  # different init per group: init_sync fixes it
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        manager = small_replica(
            group, rank, group_world_size, store, lighthouse_addr, model, inner,
            min_replica_size=num_groups,
            fingerprint_interval=interval,
            fingerprint_fn=model.parameters if params_only else None,
        )  # fmt: skip
        optimizer = Optimizer(manager, inner)
        healed_at = []
        data = torch.Generator().manual_seed(7)
        try:
            while manager.current_step() < STEPS:
                x = torch.randn(16, 4, generator=data)
                optimizer.zero_grad()
                step = manager.current_step()
                model(x).sum().backward()
                for p in model.parameters():
                    manager.allreduce(p.grad)
                optimizer.step()
                if manager.did_heal() and step > 0:  # not init_sync
                    healed_at.append(step)
                if (group, rank, manager.current_step()) in corrupt:
                    corrupt.discard((group, rank, manager.current_step()))
                    with torch.no_grad():
                        model[0].weight[0, 0] += 1e-3
            return {
                "replica_id": manager.replica_id,
                "step": manager.current_step(),
                "params": [p.detach().clone() for p in model.parameters()],
                "optim": inner.state_dict(),
                "healed_at": healed_at,
            }
        finally:
            manager.shutdown()

    with ThreadPoolExecutor(group_world_size) as pool:
        return list(pool.map(rank_main, range(group_world_size)))


def run_groups(
    num_groups: int,
    group_world_size: int = 1,
    interval: int = INTERVAL,
    corrupt: set[tuple[int, int, int]] | None = None,
    params_only: bool = False,
) -> list[list[dict]]:
    # min_replicas = every group, so all groups step in lockstep and each
    # fingerprint step compares every replica.
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=num_groups, join_timeout_ms=500, heartbeat_timeout_ms=2000
    )
    try:
        with ThreadPoolExecutor(num_groups) as pool:
            futures = [
                pool.submit(
                    train,
                    lighthouse.address(),
                    g,
                    num_groups,
                    group_world_size,
                    interval,
                    corrupt if corrupt is not None else set(),
                    params_only,
                )
                for g in range(num_groups)
            ]
            return [f.result(timeout=80) for f in futures]
    finally:
        lighthouse.shutdown()


def assert_identical(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == STEPS
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.equal(pa, pb)
    for sa, sb in zip(a["optim"]["state"].values(), b["optim"]["state"].values()):
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key]))


def divergence_logs(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and "DIVERGENCE" in r.getMessage()
    ]


def test_a_corrupted_replica_is_found_at_the_next_fingerprint_step_and_healed(caplog):
    # Corrupted after the commit that reaches step 3; step 4 is a fingerprint step.
    results = run_groups(2, group_world_size=2, corrupt={(1, 1, 3)})
    ids = [group[0]["replica_id"] for group in results]
    logs = divergence_logs(caplog)
    assert logs, "the mismatch was not logged"
    for line in logs:
        assert "at step 4 for group rank 1" in line
        assert ids[0] in line and ids[1] in line
        assert "tie, lowest replica_id" in line and f"healing {ids[1]} " in line
    # Only the corrupted rank heals.
    assert results[1][1]["healed_at"] == [4]
    assert results[1][0]["healed_at"] == []
    assert results[0][0]["healed_at"] == results[0][1]["healed_at"] == []
    for rank in range(2):
        assert_identical(results[0][rank], results[1][rank])


def test_the_majority_wins_against_the_lowest_replica_id(caplog):
    results = run_groups(3, corrupt={(0, 0, 1)}, params_only=True)
    ids = [group[0]["replica_id"] for group in results]
    logs = divergence_logs(caplog)
    assert logs, "the mismatch was not logged"
    for line in logs:
        assert "at step 2 for group rank 0" in line and "(majority)" in line
        assert all(rid in line for rid in ids)
    assert results[0][0]["healed_at"] == [2]
    assert results[1][0]["healed_at"] == results[2][0]["healed_at"] == []
    assert_identical(results[0][0], results[1][0])
    assert_identical(results[0][0], results[2][0])


def test_a_healthy_run_with_fingerprints_every_step_never_reports_a_mismatch(caplog):
    results = run_groups(2, group_world_size=2, interval=1)
    assert divergence_logs(caplog) == []
    for group in results:
        for rank in group:
            assert rank["healed_at"] == []
    for rank in range(2):
        assert_identical(results[0][rank], results[1][rank])
