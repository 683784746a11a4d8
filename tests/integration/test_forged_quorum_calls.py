"""Stray or forged ManagerService.Quorum calls against a job without a
secret cost it nothing: a real lighthouse process, two replica groups of two
ranks (threads, real Managers, gloo, HTTP healing), and a forger that calls
group 0's ManagerServer over raw gRPC as its rank 1, once at a far-ahead step
and 30 times at the current step. Every step of every rank must commit and
no step may stall (before, one far-ahead call stalled both groups for the
heal timeout and the 30 calls failed 28 steps)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from tests.integration._replica import small_replica
from tests.procs import PYTHON, wait_for_line
from tests.waiting import wait_until
from torchft_like import Optimizer

pytestmark = pytest.mark.timeout(120)
STEPS = 40
FORGE_AT = 5
"""Group 0's step at which the forger starts."""
MAX_STEP_S = 3.0
"""A step slower than this stalled (the heal timeout is 10 s)."""


def train(lighthouse: str, group: int, started: dict, forged_done: threading.Event) -> list[dict]:
    """One group of two rank threads; returns per rank its commits and step times."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def rank_main(rank: int) -> dict:
        torch.manual_seed(group)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        manager = small_replica(group, rank, 2, store, lighthouse, model, inner, min_replica_size=2)
        if group == 0 and rank == 0:
            started["address"] = manager._manager_server.address()
            started["manager"] = manager
        optimizer = Optimizer(manager, inner)
        steps = []  # (step before, committed, seconds)
        try:
            # Past STEPS until the forger is done, so every forged call meets a training job.
            while manager.current_step() < STEPS or not forged_done.is_set():
                before, start = manager.current_step(), time.monotonic()
                optimizer.zero_grad()
                model(torch.randn(8, 4)).sum().backward()
                for p in model.parameters():
                    manager.allreduce(p.grad)
                optimizer.step()
                committed = manager.current_step() == before + 1
                steps.append((before, committed, time.monotonic() - start))
                time.sleep(0.02)  # a step's pace: 4 * STEPS of them outlast the forger
                if manager.current_step() > 4 * STEPS:
                    break
            return {"step": manager.current_step(), "steps": steps}
        finally:
            manager.shutdown()

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(rank_main, range(2)))


def forge(address: str, step: int, timeout_s: float) -> tuple[str, float]:
    """One raw Quorum call as group rank 1; returns its status code's name and seconds."""
    channel = grpc.insecure_channel(address.split("://", 1)[1])
    start = time.monotonic()
    try:
        pb_grpc.ManagerServiceStub(channel).Quorum(
            pb.ManagerQuorumRequest(group_rank=1, step=step), timeout=timeout_s
        )
        return "OK", time.monotonic() - start
    except grpc.RpcError as e:
        return e.code().name, time.monotonic() - start
    finally:
        channel.close()


def test_forged_quorum_calls_cost_the_job_nothing(children, tmp_path):
    proc = children.spawn(
        [PYTHON, "-m", "lighthouse", "--min-replicas", "2", "--bind", "127.0.0.1:0",
         "--http-bind", "", "--heartbeat-timeout-ms", "2000", "--join-timeout-ms", "1000"],
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    lighthouse = wait_for_line(proc, r"lighthouse listening on (http://\S+)", 30).group(1)
    started: dict = {}
    forged_done = threading.Event()
    with ThreadPoolExecutor(2) as groups:
        futures = [groups.submit(train, lighthouse, g, started, forged_done) for g in range(2)]

        def at_the_forging_step() -> bool:
            assert not any(f.done() for f in futures), [f.result() for f in futures]
            return "manager" in started and started["manager"].current_step() >= FORGE_AT

        try:
            wait_until(at_the_forging_step, 60, "group 0 to reach the forging step")
            address, manager = started["address"], started["manager"]
            far = forge(address, 10**12, 10.0)
            with ThreadPoolExecutor(30) as forgers:
                current = []
                for _ in range(30):
                    current.append(forgers.submit(forge, address, manager.current_step(), 2.0))
                    time.sleep(0.03)  # spread over ~1 s: the forgeries meet many steps
                outcomes = [f.result() for f in current]
        finally:
            forged_done.set()
        results = [f.result(timeout=90) for f in futures]
    assert far[0] == "INVALID_ARGUMENT" and far[1] < 1.0, far
    # Each current-step call was refused as a second caller or gave way to
    # rank 1's own call; none was answered with a quorum.
    assert all(code in ("ABORTED", "DEADLINE_EXCEEDED") for code, _ in outcomes), outcomes
    for g, ranks in enumerate(results):
        for r, rank in enumerate(ranks):
            failed = [step for step, ok, _ in rank["steps"] if not ok]
            assert not failed, f"group {g} rank {r}: steps {failed} did not commit"
            slow = max(s for step, _, s in rank["steps"] if step >= FORGE_AT - 1)
            assert slow < MAX_STEP_S, f"group {g} rank {r}: a step took {slow:.1f} s"
            assert rank["step"] >= STEPS
