"""Process groups across threads on 127.0.0.1: real gloo, real TCPStore."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.distributed import ReduceOp, TCPStore

from torchft_like._work import completed_work
from torchft_like.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
    parse_store_addr,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def configure_all(store, pgs, quorum_id: int) -> None:
    with ThreadPoolExecutor(len(pgs)) as pool:
        for f in [
            pool.submit(
                pg.configure, f"127.0.0.1:{store.port}/torchft/{quorum_id}/0", f"r{i}", i, len(pgs)
            )
            for i, pg in enumerate(pgs)
        ]:
            f.result()


def allreduce_all(pgs, op) -> list[torch.Tensor]:
    tensors = [torch.full((3,), float(i + 1)) for i in range(len(pgs))]
    works = [pg.allreduce([t], op) for pg, t in zip(pgs, tensors)]
    for work in works:
        work.wait()
    return tensors


@pytest.mark.parametrize(
    "op, expected",
    [(ReduceOp.SUM, 3.0), (ReduceOp.AVG, 1.5), (ReduceOp.MAX, 2.0), (ReduceOp.MIN, 1.0)],
)
def test_allreduce_ops_across_two_ranks(store, op, expected):
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    configure_all(store, pgs, 1)
    for t in allreduce_all(pgs, op):
        assert torch.equal(t, torch.full((3,), expected))
    for pg in pgs:
        pg.shutdown()


def test_reconfigure_from_two_to_three_to_two_ranks(store):
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(3)]
    for quorum_id, members in [(1, pgs[:2]), (2, pgs), (3, pgs[1:])]:
        configure_all(store, members, quorum_id)
        n = len(members)
        for t in allreduce_all(members, ReduceOp.SUM):
            assert t[0].item() == n * (n + 1) / 2
        assert [pg.size() for pg in members] == [n] * n
    for pg in pgs:
        pg.shutdown()


def test_broadcast_allgather_and_barrier(store):
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    configure_all(store, pgs, 1)
    sent = [torch.tensor([7.0]), torch.tensor([0.0])]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: pgs[i].broadcast([sent[i]], 0).wait(), range(2)))
        outs = [[torch.zeros(1), torch.zeros(1)] for _ in range(2)]
        list(
            pool.map(
                lambda i: pgs[i].allgather([outs[i]], [torch.tensor([float(i)])]).wait(), range(2)
            )
        )
        list(pool.map(lambda i: pgs[i].barrier().wait(), range(2)))
    assert sent[1].item() == 7.0
    assert [o.item() for o in outs[1]] == [0.0, 1.0]


def test_a_collective_with_a_dead_peer_errors_in_time_and_the_wrapper_swallows_it(store):
    alive = ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=2)))
    doomed = ProcessGroupGloo(timeout=timedelta(seconds=2))
    configure_all(store, [alive, doomed], 1)
    doomed.shutdown()  # the peer goes away without a word
    start = time.monotonic()
    tensor = torch.ones(4)
    work = alive.allreduce([tensor], ReduceOp.SUM)
    work.wait()  # no exception reaches the caller
    assert time.monotonic() - start < 5
    assert alive.error() is not None
    # Later collectives are no-ops until the next configure.
    assert alive.allreduce([tensor], ReduceOp.SUM).get_future().value() == [tensor]


def test_a_collective_before_configure_is_a_clear_error():
    with pytest.raises(RuntimeError, match="before configure"):
        ProcessGroupGloo().allreduce([torch.ones(1)], ReduceOp.SUM)


def test_unsupported_ops_name_themselves():
    with pytest.raises(NotImplementedError, match="reduce_scatter"):
        ProcessGroupGloo().reduce_scatter([], [])


@pytest.mark.parametrize("addr", ["127.0.0.1:123", "nonsense", "host:port/x", ":1/x"])
def test_a_bad_store_address_is_refused_with_the_expected_form(addr):
    with pytest.raises(ValueError, match="host:port/prefix"):
        parse_store_addr(addr)


def test_store_address_keeps_slashes_in_the_prefix_and_ipv6_hosts():
    assert parse_store_addr("[::1]:29500/torchft/3/0") == ("::1", 29500, "torchft/3/0")


def test_ddp_over_the_dummy_group_constructs_and_trains():
    dummy = ProcessGroupDummy()
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2), process_group=dummy)
    model(torch.randn(4, 3)).sum().backward()
    assert dummy.num_ops > 0  # the init broadcast and the gradient allreduce were absorbed
    assert model.module.weight.grad is not None


def test_fake_wrapper_injects_errors_on_demand(store):
    pgs = [
        FakeProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=10))) for _ in range(2)
    ]
    configure_all(store, pgs, 1)
    pgs[0].fail_next_collective(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        pgs[0].allreduce([torch.ones(1)], ReduceOp.SUM)
    pgs[0].report_future_error(RuntimeError("future error"))
    works = [pg.allreduce([torch.ones(1)], ReduceOp.SUM) for pg in pgs]
    with pytest.raises(RuntimeError, match="future error"):
        works[0].get_future().wait()
    works[1].wait()


class _OneReplicaManager:
    """The only stand-in for the Manager here: ManagedProcessGroup needs just
    these three calls, and the real Manager is tested on its own."""

    def __init__(self):
        self.calls = []

    def allreduce(self, tensor, reduce_op=ReduceOp.AVG):
        self.calls.append(reduce_op)
        return completed_work(tensor)

    def num_participants(self):
        return 3

    def participating_rank(self):
        return 1


def test_managed_group_delegates_allreduce_to_the_manager():
    manager = _OneReplicaManager()
    pg = ManagedProcessGroup(manager)
    pg.allreduce([torch.ones(2)], ReduceOp.SUM).wait()
    assert manager.calls == [ReduceOp.SUM]
    assert (pg.size(), pg.rank()) == (3, 1)
    with pytest.raises(NotImplementedError, match="broadcast"):
        pg.broadcast([torch.ones(1)], 0)
