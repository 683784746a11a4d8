"""Process groups over real gloo and a real TCPStore on 127.0.0.1, ranks as threads."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from torchft_like._work import FutureWork, completed_work
from torchft_like.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
    parse_store_addr,
)

SHORT = timedelta(seconds=2)
"""Timeout for the dead-peer tests; the measured failure must land near it."""


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def pgs() -> Any:
    """Makes ProcessGroupGloo instances and shuts them all down afterwards."""
    made: list[ProcessGroupGloo] = []

    def make(n: int, timeout: timedelta = timedelta(seconds=10)) -> list[ProcessGroupGloo]:
        made.extend(ProcessGroupGloo(timeout=timeout) for _ in range(n))
        return made[-n:]

    yield make
    for pg in made:
        pg.shutdown()


def on_all_ranks(members: Sequence[Any], fn: Callable[[int, Any], Any]) -> list[Any]:
    """Runs fn(rank, pg) for every member at once, as separate processes would."""
    with ThreadPoolExecutor(len(members)) as pool:
        return [f.result() for f in [pool.submit(fn, i, pg) for i, pg in enumerate(members)]]


def configure_all(store: dist.TCPStore, members: Sequence[Any], quorum_id: int) -> None:
    """Every member joins quorum `quorum_id`. A join that timed out (a 2 s
    group whose other member the loaded machine started late) is tried once
    more under another prefix: the rendezvous is not what these tests check."""
    for attempt in range(2):
        addr = f"127.0.0.1:{store.port}/torchft/{quorum_id}/{attempt}"
        try:
            on_all_ranks(
                members, lambda i, pg, a=addr: pg.configure(a, f"replica_{i}", i, len(members))
            )
            return
        except dist.DistStoreError:
            if attempt:
                raise


def allreduce_on_all(members: Sequence[Any], op: ReduceOp) -> list[list[torch.Tensor]]:
    """Each rank contributes [rank + 1] * 3; returns what each future resolved to."""
    works = [pg.allreduce([torch.full((3,), i + 1.0)], op) for i, pg in enumerate(members)]
    return [work.get_future().wait() for work in works]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "op, expected",
    [(ReduceOp.SUM, 3.0), (ReduceOp.AVG, 1.5), (ReduceOp.MAX, 2.0), (ReduceOp.MIN, 1.0)],
)
def test_allreduce_of_two_ranks_resolves_to_the_reduced_tensor_list(store, pgs, op, expected):
    members = pgs(2)
    configure_all(store, members, quorum_id=1)
    for result in allreduce_on_all(members, op):
        assert isinstance(result, list)  # what a DDP comm hook needs from the future
        assert torch.equal(result[0], torch.full((3,), expected))


@pytest.mark.timeout(60)
def test_reconfiguring_from_two_to_three_to_two_ranks_uses_the_new_membership(store, pgs):
    a, b, c = pgs(3)
    for quorum_id, members in [(1, [a, b]), (2, [a, b, c]), (3, [b, c])]:
        configure_all(store, members, quorum_id)
        n = len(members)
        assert [(pg.rank(), pg.size()) for pg in members] == [(i, n) for i in range(n)]
        for result in allreduce_on_all(members, ReduceOp.SUM):
            assert result[0][0].item() == n * (n + 1) / 2


@pytest.mark.timeout(60)
def test_broadcast_allgather_barrier_and_send_recv_reach_the_peer(store, pgs):
    members = pgs(2)
    configure_all(store, members, quorum_id=1)

    def exchange(rank: int, pg: ProcessGroupGloo) -> tuple[float, list[float], float]:
        sent = torch.tensor([7.0 if rank == 0 else 0.0])
        pg.broadcast([sent], 0).wait()
        gathered = [torch.zeros(1), torch.zeros(1)]
        pg.allgather([gathered], [torch.tensor([float(rank)])]).wait()
        pg.barrier().wait()
        p2p = torch.tensor([5.0 if rank == 0 else 0.0])
        if rank == 0:
            pg.send([p2p], 1, 0).wait()
        else:
            assert pg.recv([p2p], 0, 0).get_future().wait() == [p2p]
        return sent.item(), [t.item() for t in gathered], p2p.item()

    assert on_all_ranks(members, exchange)[1] == (7.0, [0.0, 1.0], 5.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "collective",
    [
        lambda pg: pg.allreduce([torch.ones(4)], ReduceOp.AVG),
        lambda pg: pg.broadcast([torch.ones(4)], 0),
        lambda pg: pg.recv([torch.ones(4)], 1, 0),
    ],
    ids=["allreduce_avg", "broadcast", "recv"],
)
def test_a_collective_with_a_hung_peer_fails_within_the_timeout(store, pgs, collective):
    alive, hung = pgs(2, timeout=SHORT)
    configure_all(store, [alive, hung], quorum_id=1)
    start = time.monotonic()
    work = collective(alive)
    with pytest.raises(RuntimeError, match="Timed out"):
        work.wait()
    elapsed = time.monotonic() - start
    assert SHORT.total_seconds() - 0.5 < elapsed < SHORT.total_seconds() + 3
    assert "Timed out" in str(alive.errored())


@pytest.mark.timeout(60)
def test_a_late_failure_of_the_replaced_group_does_not_mark_the_new_one_errored(store, pgs):
    a, b, c = pgs(3, timeout=SHORT)
    configure_all(store, [a, b], quorum_id=1)
    stuck = a.allreduce([torch.ones(1)], ReduceOp.SUM)  # b never joins in, nor hangs up
    configure_all(store, [a, c], quorum_id=2)
    with pytest.raises(RuntimeError, match="Timed out"):
        stuck.wait()  # aborting a gloo group does not end its in-flight collectives
    assert a.errored() is None
    assert allreduce_on_all([a, c], ReduceOp.SUM)[0][0][0].item() == 3.0


@pytest.mark.timeout(60)
def test_configure_with_an_absent_peer_fails_within_the_timeout(store, pgs):
    (lonely,) = pgs(1, timeout=SHORT)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        lonely.configure(f"127.0.0.1:{store.port}/torchft/1/0", "replica_0", 0, 2)
    assert time.monotonic() - start < SHORT.total_seconds() + 3
    with pytest.raises(RuntimeError, match="before configure"):
        lonely.allreduce([torch.ones(1)], ReduceOp.SUM)


@pytest.mark.timeout(60)
def test_the_swallowing_wrapper_records_a_dead_peer_and_recovers_on_configure(store, pgs):
    inner, peer = pgs(2, timeout=SHORT)
    wrapped = ErrorSwallowingProcessGroupWrapper(inner)
    configure_all(store, [wrapped, peer], quorum_id=1)
    peer.shutdown()  # the peer's sockets close, as when its process is killed

    start = time.monotonic()
    tensor = torch.ones(4)
    assert wrapped.allreduce([tensor], ReduceOp.SUM).get_future().wait() == [tensor]
    assert time.monotonic() - start < SHORT.total_seconds() + 3
    assert wrapped.error() is not None
    # Later collectives are no-ops that complete at once, until reconfigured.
    assert wrapped.broadcast([tensor], 0).is_completed()

    configure_all(store, [wrapped, peer], quorum_id=2)
    assert wrapped.error() is None
    results = allreduce_on_all([wrapped, peer], ReduceOp.SUM)
    assert results[0][0][0].item() == 3.0


@pytest.mark.timeout(60)
def test_ddp_over_the_dummy_group_constructs_and_trains_one_step():
    dummy = ProcessGroupDummy()
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), process_group=dummy
    )
    absorbed_at_init = dummy.num_ops  # parameter check (allgather) and broadcasts
    assert absorbed_at_init >= 2
    model(torch.randn(5, 3)).sum().backward()
    assert dummy.num_ops > absorbed_at_init  # buffer broadcast and gradient allreduce
    assert model.module[0].weight.grad is not None


@pytest.mark.timeout(60)
def test_the_dummy_group_completes_every_collective_with_its_inputs():
    dummy = ProcessGroupDummy(rank=1, world=2)
    tensor = torch.arange(3.0)
    assert dummy.allreduce([tensor]).get_future().wait() == [tensor]
    gathered = [torch.zeros(3), torch.zeros(3)]
    dummy.allgather([gathered], [tensor]).wait()
    flat = torch.zeros(6)
    dummy._allgather_base(flat, tensor).wait()
    assert all(torch.equal(t, tensor) for t in gathered)
    assert torch.equal(flat, torch.cat([tensor, tensor]))
    assert dummy.barrier().is_completed()
    assert (dummy.rank(), dummy.size(), dummy.num_ops) == (1, 2, 4)


@pytest.mark.timeout(60)
def test_the_fake_wrapper_fails_the_next_future_or_call_on_demand():
    fake = FakeProcessGroupWrapper(ProcessGroupDummy())
    fake.report_future_error(RuntimeError("peer lost"))
    with pytest.raises(RuntimeError, match="peer lost"):
        fake.allreduce([torch.ones(1)], ReduceOp.SUM).get_future().wait()
    fake.fail_next_collective(ConnectionError("refused"))
    with pytest.raises(ConnectionError, match="refused"):
        fake.broadcast([torch.ones(1)], 0)
    fake.allreduce([torch.ones(1)], ReduceOp.SUM).wait()  # each injection fires once


@pytest.mark.timeout(60)
def test_the_swallowing_wrapper_records_an_injected_future_error():
    fake = FakeProcessGroupWrapper(ProcessGroupDummy())
    wrapped = ErrorSwallowingProcessGroupWrapper(fake)
    fake.report_future_error(RuntimeError("peer lost"))
    tensor = torch.ones(1)
    assert wrapped.allreduce([tensor], ReduceOp.SUM).get_future().wait() == [tensor]
    assert str(wrapped.error()) == "peer lost"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "addr", ["127.0.0.1:29500", "nonsense", "host:port/x", ":1/x", "127.0.0.1:29500/"]
)
def test_a_bad_store_address_is_refused_naming_it_and_the_expected_form(addr):
    with pytest.raises(ValueError, match="host:port/prefix") as raised:
        ProcessGroupGloo().configure(addr, "replica_0", 0, 1)
    assert repr(addr) in str(raised.value)


@pytest.mark.timeout(60)
def test_a_store_address_keeps_slashes_in_the_prefix_and_accepts_ipv6_hosts():
    assert parse_store_addr("[::1]:29500/torchft/3/0") == ("::1", 29500, "torchft/3/0")
    assert parse_store_addr("node-7:1/a/b") == ("node-7", 1, "a/b")


@pytest.mark.timeout(60)
def test_a_group_meets_over_an_ipv6_store_address(pgs):
    try:
        store = dist.TCPStore("::1", 0, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    members = pgs(2)
    addr = f"[::1]:{store.port}/torchft/1/0"
    on_all_ranks(members, lambda i, pg: pg.configure(addr, f"replica_{i}", i, 2))
    assert allreduce_on_all(members, ReduceOp.SUM)[0][0][0].item() == 3.0


@pytest.mark.timeout(60)
def test_collectives_before_configure_and_unsupported_ops_are_clear_errors():
    pg = ProcessGroupGloo()
    with pytest.raises(RuntimeError, match="allreduce before configure"):
        pg.allreduce([torch.ones(1)], ReduceOp.SUM)
    with pytest.raises(RuntimeError, match="recv before configure"):
        pg.recv([torch.ones(1)], 0, 0)
    with pytest.raises(RuntimeError, match="reduce_scatter before configure"):
        pg.reduce_scatter([torch.ones(1)], [[torch.ones(1)]])
    with pytest.raises(NotImplementedError, match="does not support alltoall;"):
        pg.alltoall([], [])
    assert (pg.getBackendName(), pg.errored()) == ("torchft-gloo", None)
    pg.shutdown()
    pg.shutdown()  # idempotent


class _FakeManager:
    """Stands in for the Manager, which ManagedProcessGroup only duck-types."""

    def __init__(self) -> None:
        self.reduce_ops: list[ReduceOp] = []

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG) -> Any:
        self.reduce_ops.append(reduce_op)
        return completed_work(tensor.mul_(2))  # resolves to the tensor, as the Manager's does

    def num_participants(self) -> int:
        return 3

    def participating_rank(self) -> int | None:
        return None  # a spare: rank() falls back to 0


@pytest.mark.timeout(60)
def test_the_managed_group_sends_allreduce_through_the_manager():
    manager = _FakeManager()
    pg = ManagedProcessGroup(manager)
    tensor = torch.ones(2)
    assert pg.allreduce([tensor], ReduceOp.AVG).get_future().wait() is tensor
    assert torch.equal(tensor, torch.full((2,), 2.0))
    assert manager.reduce_ops == [ReduceOp.AVG]
    assert (pg.size(), pg.rank()) == (3, 0)
    for op, args in [
        ("broadcast", ([tensor], 0)),
        ("allreduce_coalesced", ([tensor],)),
        ("reduce_scatter", ([tensor], [[tensor]])),
    ]:
        with pytest.raises(RuntimeError, match=f"does not support {op};"):
            getattr(pg, op)(*args)


class _StuckManager(_FakeManager):
    """A Manager whose allreduce work never completes (a peer that hangs)."""

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG) -> Any:
        self.reduce_ops.append(reduce_op)
        self.pending: torch.futures.Future[Any] = torch.futures.Future()
        return FutureWork(self.pending)


@pytest.mark.timeout(60)
def test_the_managed_group_returns_the_managers_work_itself():
    manager = _StuckManager()
    work = ManagedProcessGroup(manager).allreduce([torch.ones(2)], ReduceOp.SUM)
    assert work.get_future() is manager.pending  # nothing chained that could hang apart
    manager.pending.set_result(torch.ones(2))
    assert work.wait()


@pytest.mark.timeout(60)
def test_coalesced_scatter_and_alltoall_collectives_of_two_ranks_give_the_reduced_values(
    store, pgs
):
    members = pgs(2)
    configure_all(store, members, quorum_id=1)

    def run(rank: int, pg: ProcessGroupGloo) -> dict[str, list[float]]:
        r = float(rank)
        a, b = torch.tensor([r + 1]), torch.tensor([r + 10])
        pg.allreduce_coalesced([a, b]).wait()
        g0, g1 = torch.zeros(2), torch.zeros(2)
        pg.allgather_into_tensor_coalesced(
            [g0, g1], [torch.tensor([r]), torch.tensor([r + 5])]
        ).wait()
        rows = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
        rs = torch.zeros(2)
        pg.reduce_scatter([rs], [rows]).wait()
        rc0, rc1 = torch.zeros(1), torch.zeros(1)
        work = pg.reduce_scatter_tensor_coalesced(
            [rc0, rc1], [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])]
        )
        work.get_future().wait()
        a2a = torch.zeros(2)
        pg.alltoall_base(a2a, torch.tensor([r * 2, r * 2 + 1]), [1, 1], [1, 1]).wait()
        one = torch.tensor([7.0]) if rank == 1 else torch.zeros(1)
        pg.broadcast_one(one, 1).wait()
        return {
            "coalesced": [a.item(), b.item()],
            "gathered": g0.tolist() + g1.tolist(),
            "scattered": rs.tolist(),
            "scattered_coalesced": [rc0.item(), rc1.item()],
            "alltoall": a2a.tolist(),
            "broadcast_one": [one.item()],
        }

    first, second = on_all_ranks(members, run)
    assert first == {
        "coalesced": [3.0, 21.0],
        "gathered": [0.0, 1.0, 5.0, 6.0],
        "scattered": [2.0, 4.0],
        "scattered_coalesced": [2.0, 20.0],
        "alltoall": [0.0, 2.0],
        "broadcast_one": [7.0],
    }
    assert second["scattered"] == [6.0, 8.0]
    assert second["scattered_coalesced"] == [4.0, 40.0]
    assert second["alltoall"] == [1.0, 3.0]


@pytest.mark.timeout(60)
def test_a_registered_group_serves_functional_collectives_by_name(store, pgs):
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    (pg,) = pgs(1)
    configure_all(store, [pg], quorum_id=1)
    with pytest.raises(RuntimeError, match="call register"):
        pg.group_name  # noqa: B018 (the property raises)
    assert pg.register("ft_replicas") is pg
    try:
        assert pg.group_name == str(dist.get_pg_count() - 1)
        assert c10d._resolve_process_group(pg.group_name) is pg
        out = funcol.all_reduce(torch.full((3,), 2.0), "sum", pg)
        assert torch.equal(funcol.wait_tensor(out), torch.full((3,), 2.0))
    finally:
        pg.unregister()


@pytest.mark.timeout(60)
def test_a_failed_collective_aborts_the_group_until_configure(store, pgs):
    alive, dead = pgs(2, timeout=SHORT)
    configure_all(store, [alive, dead], quorum_id=1)
    dead.shutdown()
    with pytest.raises(RuntimeError):
        alive.allreduce([torch.ones(1)], ReduceOp.SUM).wait()
    error = alive.errored()
    assert isinstance(error, RuntimeError) and "aborted" in str(error)
    with pytest.raises(RuntimeError, match="aborted"):
        alive.allreduce([torch.ones(1)], ReduceOp.SUM)  # fails at once, no timeout
    (fresh,) = pgs(1, timeout=SHORT)
    configure_all(store, [alive, fresh], quorum_id=2)
    assert alive.errored() is None
    assert allreduce_on_all([alive, fresh], ReduceOp.SUM)[0][0][0].item() == 3.0


def test_the_dummy_group_counts_configures_and_the_wrapper_names_what_it_wraps():
    from torchft_like.process_group import _ProcessGroupWrapper

    dummy = ProcessGroupDummy(0, 1)
    wrapper = _ProcessGroupWrapper(dummy)
    wrapper.configure("unused:0/prefix", "0", 0, 1)
    assert dummy.configure_count == 1
    assert repr(wrapper) == "ProcessGroupWrapper(pg=ProcessGroupDummy())"
    assert repr(ErrorSwallowingProcessGroupWrapper(dummy)).startswith("ErrorSwallowing")
