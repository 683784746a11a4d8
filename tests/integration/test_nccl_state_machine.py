"""ProcessGroupNCCL's state machine on a machine without a GPU: torch's gloo
backend stands in for NCCL's (the same backend API), injected through
`backend_factory`; ranks are threads, the store a real TCPStore.

What only a GPU can show (ncclCommAbort ending a kernel, CUDA streams) is
in tests/gpu/ and scripts/gpu_check.sh; the code path here is the same.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tests.waiting import wait_until
from torchft_like.process_group import ProcessGroupNCCL
from torchft_like.process_group.nccl import nccl_missing


def gloo_standin(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> dist.ProcessGroupGloo:
    """gloo's backend where NCCL's would be, bound to loopback."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def groups() -> Any:
    made: list[ProcessGroupNCCL] = []

    def make(n: int) -> list[ProcessGroupNCCL]:
        made.extend(
            ProcessGroupNCCL(timedelta(seconds=10), backend_factory=gloo_standin) for _ in range(n)
        )
        return made[-n:]

    yield make
    for pg in made:
        pg.shutdown()


def on_all(members: Sequence[Any], fn: Callable[[int, Any], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(members)) as pool:
        return [f.result() for f in [pool.submit(fn, i, pg) for i, pg in enumerate(members)]]


def configure(store: dist.TCPStore, members: Sequence[ProcessGroupNCCL], prefix: str) -> None:
    addr = f"127.0.0.1:{store.port}/{prefix}"
    on_all(members, lambda i, pg: pg.configure(addr, f"replica_{i}", i, len(members)))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
def test_collectives_then_errored_is_none_once_they_finished(store, groups) -> None:
    members = groups(2)
    configure(store, members, "q/1")
    works = [
        pg.allreduce([torch.full((4,), i + 1.0)], ReduceOp.SUM) for i, pg in enumerate(members)
    ]
    values = [w.get_future().wait() for w in works]
    assert all(torch.equal(v[0], torch.full((4,), 3.0)) for v in values)
    assert [pg.errored() for pg in members] == [None, None]
    assert [pg.num_active_work() for pg in members] == [0, 0]
    assert [(pg.rank(), pg.size()) for pg in members] == [(0, 2), (1, 2)]
    # and the ops beside allreduce, on the same communicator
    outs = [[torch.zeros(2), torch.zeros(2)] for _ in members]
    works = [pg.allgather([outs[i]], [torch.full((2,), float(i))]) for i, pg in enumerate(members)]
    for w in works:
        w.wait()
    assert all(torch.equal(torch.stack(o), torch.tensor([[0.0, 0.0], [1.0, 1.0]])) for o in outs)
    gathered = [torch.zeros(4) for _ in members]
    works = [
        pg.allgather_into_tensor_coalesced([gathered[i]], [torch.full((2,), float(i))])
        for i, pg in enumerate(members)
    ]
    for w in works:
        w.get_future().wait()
    assert all(torch.equal(g, torch.tensor([0.0, 0.0, 1.0, 1.0])) for g in gathered)
    received = torch.zeros(3)
    sent = members[0].send([torch.arange(3.0)], 1)
    members[1].recv([received], 0).wait()
    sent.wait()
    assert torch.equal(received, torch.arange(3.0))


@pytest.mark.timeout(60)
def test_abort_fails_a_collective_in_flight_at_once_and_configure_builds_anew(
    store, groups
) -> None:
    members = groups(2)
    configure(store, members, "q/1")
    # rank 1 never joins: rank 0's allreduce hangs until aborted
    work = members[0].allreduce([torch.ones(3)], ReduceOp.SUM)
    time.sleep(0.2)
    assert not work.get_future().done()
    started = time.monotonic()
    members[0].abort()
    with pytest.raises(RuntimeError, match="aborted"):
        work.get_future().wait()
    assert time.monotonic() - started < 0.5
    assert isinstance(members[0].errored(), RuntimeError)
    with pytest.raises(RuntimeError, match="aborted"):
        members[0].allreduce([torch.ones(3)], ReduceOp.SUM)
    members[1].abort(errored=False)
    assert members[1].errored() is None
    configure(store, members, "q/2")
    # the aborted communicator is gone before the next one is built
    assert not any(t.is_alive() for pg in members for t in pg._droppers)
    assert [pg.errored() for pg in members] == [None, None]
    works = [pg.allreduce([torch.ones(3)], ReduceOp.AVG) for pg in members]
    assert all(torch.equal(w.get_future().wait()[0], torch.ones(3)) for w in works)


@pytest.mark.timeout(60)
def test_a_collective_past_its_timeout_aborts_the_communicator(store, groups) -> None:
    timeout_s = 1.0
    members = groups(2)  # the join has room on a loaded machine
    configure(store, members, "q/1")
    members[0].set_timeout(timedelta(seconds=timeout_s))  # the collectives' bound from now on
    started = time.monotonic()
    work = members[0].allreduce([torch.ones(3)], ReduceOp.SUM)  # rank 1 never joins
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        work.get_future().wait()
    took = time.monotonic() - started
    assert timeout_s <= took < timeout_s + 1.0
    error = members[0].errored()
    assert isinstance(error, TimeoutError) and "allreduce" in str(error)
    with pytest.raises(TimeoutError):
        members[0].barrier()


@pytest.mark.timeout(60)
def test_errored_waits_for_the_collectives_in_flight(store, groups) -> None:
    members = groups(2)
    configure(store, members, "q/1")
    members[0].set_timeout(timedelta(seconds=2))
    work = members[0].allreduce([torch.ones(3)], ReduceOp.SUM)
    late = threading.Timer(0.5, lambda: members[1].allreduce([torch.ones(3)], ReduceOp.SUM))
    late.start()
    started = time.monotonic()
    assert members[0].errored() is None  # returns once rank 1 joined and it finished
    assert 0.4 < time.monotonic() - started < 2.0
    assert work.is_completed()
    late.join()


@pytest.mark.timeout(120)
def test_reconfigure_many_times_holds_no_fds_or_threads(store, groups) -> None:
    members = groups(2)

    def round_(n: int) -> None:
        configure(store, members, f"q/{n}")
        works = [pg.allreduce([torch.ones(8)], ReduceOp.SUM) for pg in members]
        for w in works:
            w.wait()
        if n % 2:
            members[0].abort()  # an abort between quorums, as a gone notice makes

    for n in range(5):  # warm-up: the store's sockets, the watchdog threads
        round_(n)
    fds, threads = open_fds(), threading.active_count()
    for n in range(5, 30):
        round_(n)
    droppers = [t for pg in members for t in pg._droppers]
    wait_until(lambda: not any(t.is_alive() for t in droppers), 10, "the aborts' drops to end")
    assert open_fds() - fds <= 2
    assert threading.active_count() - threads <= 2


def test_on_a_machine_without_a_gpu_one_clear_line() -> None:
    if nccl_missing() is None:
        pytest.skip("this machine can run NCCL")
    with pytest.raises(RuntimeError) as caught:
        ProcessGroupNCCL()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("ProcessGroupNCCL: ")
    assert "CUDA" in message
