"""ProcessGroupBabyNCCL's state machine on a machine without a GPU: its
child runs gloo where NCCL would be (`child_backend="gloo"`), with the same
parent: the standby child, the watchdog that kills an overdue collective's
child, errored(), and configuring again after an abort. Two members as
threads of this process, each with its own child, a real TCPStore.

The CUDA IPC staging runs only on a GPU (tests/gpu/, scripts/gpu_check.sh).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tests.waiting import wait_until
from torchft_like.process_group import ProcessGroupBabyNCCL
from torchft_like.process_group.nccl import nccl_missing

pytestmark = pytest.mark.timeout(180)


class Pair:
    def __init__(self, timeout_s: float) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.pgs = [
            ProcessGroupBabyNCCL(timedelta(seconds=timeout_s), child_backend="gloo")
            for _ in range(2)
        ]
        self.pool = ThreadPoolExecutor(2)

    def configure(self, prefix: str) -> None:
        addr = f"127.0.0.1:{self.store.port}/{prefix}"
        list(self.pool.map(lambda r: self.pgs[r].configure(addr, f"r{r}", r, 2), range(2)))

    def allreduce(self, op: ReduceOp = ReduceOp.SUM) -> list[torch.Tensor]:
        ts = [torch.full((3,), float(r + 1)) for r in range(2)]
        for w in [self.pgs[r].allreduce([ts[r]], op) for r in range(2)]:
            w.wait()
        return ts

    def close(self) -> None:
        for pg in self.pgs:
            pg.shutdown()
        self.pool.shutdown()


@pytest.fixture
def pair():
    made: list[Pair] = []

    def make() -> Pair:
        made.append(Pair(30.0))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_collectives_use_the_standby_child_and_errored_is_none(pair) -> None:
    p = pair()
    standbys = [pg._standby for pg in p.pgs]
    p.configure("q/1")
    assert [pg._child for pg in p.pgs] == standbys, "configure took the warm standby"
    assert all(pg._standby is not None and pg._standby.is_alive() for pg in p.pgs)
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in p.allreduce())
    assert all(torch.equal(t, torch.full((3,), 1.5)) for t in p.allreduce(ReduceOp.AVG))
    assert [pg.errored() for pg in p.pgs] == [None, None]
    assert [pg.getBackendName() for pg in p.pgs] == ["torchft-baby-nccl"] * 2


def test_an_overdue_collective_kills_the_child_then_configure_works(pair) -> None:
    p = pair()  # configure with room for a child that starts on a loaded machine
    p.configure("q/1")
    for pg in p.pgs:
        pg.set_timeout(timedelta(seconds=1))  # the collectives' bound from now on
    child = p.pgs[0]._child
    assert child is not None
    stuck = torch.zeros(4)
    started = time.monotonic()
    work = p.pgs[0].allreduce([stuck], ReduceOp.SUM)  # member 1 never enters
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        work.wait()
    assert 1.0 <= time.monotonic() - started < 2.0
    child.proc.wait(timeout=10)
    assert isinstance(p.pgs[0].errored(), TimeoutError)
    assert torch.equal(stuck, torch.zeros(4)), "a killed collective leaves the tensor alone"
    p.pgs[1].abort(errored=False)
    for pg in p.pgs:
        pg.set_timeout(timedelta(seconds=30))
    p.configure("q/2")
    assert [pg.errored() for pg in p.pgs] == [None, None]
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in p.allreduce())


def test_abort_in_flight_fails_at_once_and_reconfiguring_leaks_nothing(pair) -> None:
    p = pair()
    p.configure("q/0")
    p.allreduce()
    fds = len(os.listdir("/proc/self/fd"))
    for n in range(1, 6):
        work = p.pgs[0].allreduce([torch.ones(2)], ReduceOp.SUM)
        started = time.monotonic()
        p.pgs[0].abort()
        with pytest.raises(RuntimeError, match="aborted"):
            work.wait()
        assert time.monotonic() - started < 1.0
        p.pgs[1].abort(errored=False)
        p.configure(f"q/{n}")
        assert all(torch.equal(t, torch.full((3,), 3.0)) for t in p.allreduce())
    # the reapers close the killed children's sockets (a leak never gets there)
    wait_until(lambda: len(os.listdir("/proc/self/fd")) - fds <= 2, 10, "the fds to come back")


def test_nccl_on_a_machine_without_a_gpu_is_one_clear_line() -> None:
    if nccl_missing() is None:
        pytest.skip("this machine can run NCCL")
    with pytest.raises(RuntimeError) as caught:
        ProcessGroupBabyNCCL()
    assert str(caught.value).startswith("ProcessGroupBabyNCCL: NCCL needs a CUDA GPU")
    with pytest.raises(ValueError, match="child_backend"):
        ProcessGroupBabyNCCL(child_backend="mpi")
