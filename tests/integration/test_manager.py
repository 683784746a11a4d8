"""Manager with a real lighthouse, real gloo and real HTTP transfers; replica
groups are threads in this process, each with its own TCPStore."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from tests.integration._replica import small_replica
from torchft_like import Optimizer, ProcessGroupGloo
from torchft_like.checkpointing import HTTPTransport
from torchft_like.process_group import FakeProcessGroupWrapper

pytestmark = pytest.mark.timeout(90)
TIMEOUT = timedelta(seconds=10)


def _lighthouse(min_replicas: int):
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=500,
        heartbeat_timeout_ms=1000,
    )  # fmt: skip
    yield server
    server.shutdown()


@pytest.fixture
def lighthouse():
    yield from _lighthouse(1)


@pytest.fixture
def lighthouse_of_two():
    """Quorums of both groups only: with one, a group slower than the join
    timeout under load would be left out of a step, which then would not
    commit for too few replicas, whatever the test injected; or the other
    group trained alone to the end, and the late one, at step 0 with no
    live group to heal from, was refused a fresh start until it timed out."""
    yield from _lighthouse(2)


@dataclass
class Faults:
    """Failures to inject: (replica group, step) -> error on the next collective."""

    at: dict[tuple[int, int], Exception] = field(default_factory=dict)


def train(
    lighthouse_addr: str,
    group: int,
    steps: int,
    group_world_size: int = 1,
    faults: Faults | None = None,
    start: threading.Event | None = None,
    min_replica_size: int = 1,
    step_sleep: float = 0.0,
    reached: tuple[int, threading.Event] | None = None,
) -> list[dict]:
    """One replica group: `group_world_size` ranks as threads, each training a
    small model with the Optimizer wrapper. Returns each rank's final state."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if start is not None:
        start.wait(30)

    def rank_main(rank: int) -> dict:
        torch.manual_seed(100 + group)  # different init per group: init_sync must fix it
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))
        manager = small_replica(
            group, rank, group_world_size, store, lighthouse_addr, model, inner,
            pg=pg, min_replica_size=min_replica_size,
        )  # fmt: skip
        optimizer = Optimizer(manager, inner)
        commits = []
        data = torch.Generator().manual_seed(7)
        try:
            while manager.current_step() < steps:
                x = torch.randn(16, 4, generator=data)
                optimizer.zero_grad()
                step = manager.current_step()
                if faults and (group, step) in faults.at:
                    pg.fail_next_collective(faults.at.pop((group, step)))
                model(x).sum().backward()
                for p in model.parameters():
                    manager.allreduce(p.grad)
                optimizer.step()
                commits.append((step, manager.current_step() > step))
                time.sleep(step_sleep)
                if reached is not None and manager.current_step() >= reached[0]:
                    reached[1].set()
            return {
                "step": manager.current_step(),
                "params": [p.detach().clone() for p in model.parameters()],
                "optim": inner.state_dict(),
                "commits": commits,
                "healed": manager.batches_committed(),
                "stripes": getattr(manager._checkpoint_transport, "last_stripe_report", None),
            }
        finally:
            manager.shutdown()

    with ThreadPoolExecutor(group_world_size) as pool:
        return list(pool.map(rank_main, range(group_world_size)))


def run_groups(lighthouse, num_groups: int, steps: int, **kwargs) -> list[list[dict]]:
    with ThreadPoolExecutor(num_groups) as pool:
        futures = [
            pool.submit(train, lighthouse.address(), g, steps, **kwargs) for g in range(num_groups)
        ]
        return [f.result(timeout=80) for f in futures]


def assert_identical(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.equal(pa, pb)
    for sa, sb in zip(a["optim"]["state"].values(), b["optim"]["state"].values()):
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key]))


def test_healthy_run_of_two_groups_ends_bit_identical(lighthouse_of_two):
    results = run_groups(lighthouse_of_two, 2, steps=5, min_replica_size=2)
    assert_identical(results[0][0], results[1][0])
    assert results[0][0]["step"] == 5


def test_groups_of_two_ranks_train_and_match_rank_by_rank(lighthouse_of_two):
    results = run_groups(lighthouse_of_two, 2, steps=4, group_world_size=2)
    for rank in range(2):
        assert_identical(results[0][rank], results[1][rank])


def test_a_late_replica_heals_from_a_peer_and_ends_bit_identical(lighthouse):
    with ThreadPoolExecutor(2) as pool:
        late_start = threading.Event()
        early = pool.submit(
            train, lighthouse.address(), 0, 20, step_sleep=0.1, reached=(5, late_start)
        )
        late = pool.submit(train, lighthouse.address(), 1, 20, start=late_start, step_sleep=0.1)
        early_result, late_result = early.result(timeout=80)[0], late.result(timeout=80)[0]
    assert_identical(early_result, late_result)
    # The late group joined mid-run: it did fewer steps of its own than the early one.
    assert len(late_result["commits"]) < len(early_result["commits"])


def test_a_late_replica_heals_striped_from_both_up_to_date_peers(lighthouse):
    with ThreadPoolExecutor(3) as pool:
        late_start = threading.Event()
        early = [
            pool.submit(train, lighthouse.address(), g, 14, step_sleep=0.1,
                        reached=(4, late_start) if g == 0 else None)
            for g in (0, 1)
        ]  # fmt: skip
        late = pool.submit(train, lighthouse.address(), 2, 14, start=late_start, step_sleep=0.1)
        results = [f.result(timeout=80)[0] for f in [*early, late]]
    for other in results[1:]:
        assert_identical(results[0], other)
    report = results[2]["stripes"]
    assert report is not None, "the late replica healed from one peer, not striped"
    assert len(report.sources) == 2 and not report.errors
    assert all(n > 0 for n in report.bytes_by_source), report.summary()


def test_an_injected_allreduce_failure_uncommits_that_step_on_every_group(lighthouse_of_two):
    faults = Faults({(0, 2): RuntimeError("injected collective failure")})
    results = run_groups(lighthouse_of_two, 2, steps=5, faults=faults, min_replica_size=2)
    for group in results:
        failed = [step for step, committed in group[0]["commits"] if not committed]
        assert failed == [2]
    assert_identical(results[0][0], results[1][0])


class _TransportHeldUntil(HTTPTransport):
    """A real HTTP transport whose receive, once the source has accepted it,
    pauses until `released` (at most `wait_s`) and records whether that came:
    it shows what else ran while a heal was still in flight."""

    def __init__(self, released: threading.Event, wait_s: float) -> None:
        super().__init__(timeout=TIMEOUT, hostname="127.0.0.1")
        self.released, self.wait_s, self.saw_release = released, wait_s, False

    def recv_checkpoint_striped(self, sources, step, timeout, *, on_begun=None, **kwargs):
        def begun() -> None:
            on_begun()
            self.saw_release = self.released.wait(self.wait_s)

        return super().recv_checkpoint_striped(sources, step, timeout, on_begun=begun, **kwargs)


def test_a_healing_replica_allreduces_while_its_state_is_still_arriving(lighthouse):
    early_reached = threading.Event()
    allreduced = threading.Event()
    transport = _TransportHeldUntil(allreduced, wait_s=5)

    def late_group() -> dict:
        early_reached.wait(30)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        manager = small_replica(
            1, 0, 1, store, lighthouse.address(), model, inner, checkpoint_transport=transport
        )
        try:
            optimizer = Optimizer(manager, inner)
            optimizer.zero_grad()
            model(torch.randn(16, 4)).sum().backward()
            for work in [manager.allreduce(p.grad) for p in model.parameters()]:
                work.wait()
            allreduced.set()  # before the heal was let through: it did not wait for it
            optimizer.step()
            return {"healed": manager.did_heal(), "step": manager.current_step()}
        finally:
            manager.shutdown()

    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(
            train, lighthouse.address(), 0, 12, step_sleep=0.05, reached=(3, early_reached)
        )
        late = pool.submit(late_group).result(timeout=60)
        early.result(timeout=60)
    assert late["healed"]
    assert transport.saw_release, "the allreduces waited for the healing transfer to finish"
    assert late["step"] > 3


def test_before_the_first_quorum_nobody_participates_and_nothing_blocks(lighthouse):
    """As torchft: torchtitan's checkpointer asks after every step, the first
    one included, before any quorum was started."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = small_replica(0, 0, 1, store, lighthouse.address(), model, inner)
    try:
        assert manager.participating_rank() is None
        assert manager.num_participants() == 0
        assert not manager.is_participating()
        manager.start_quorum()
        assert manager.participating_rank() == 0 and manager.num_participants() == 1
    finally:
        manager.shutdown()


def test_a_healing_source_that_died_costs_about_a_second_not_the_connect_timeout(lighthouse):
    """Its ManagerServer's port refuses: the heal fails within about a second
    (then the step, and the next quorum no longer lists it), though the
    Manager's connect timeout is 30 s."""
    import socket

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = small_replica(0, 0, 1, store, lighthouse.address(), model, inner,
                            connect_timeout=timedelta(seconds=30))  # fmt: skip
    with socket.socket() as s:  # a port nobody listens on, as after a death
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        start = time.monotonic()
        with pytest.raises(Exception, match=rf"could not connect to .*{dead} within 1.0 s"):
            manager._metadata_of(dead)
        assert time.monotonic() - start < 3
    finally:
        manager.shutdown()
