"""Hundreds of quorum changes (replicas joining and leaving) must leave the
threads, file descriptors, Python objects and memory of the lighthouse and of
a manager where they were after a warm-up.

Everything runs in this process, so one psutil view covers the lighthouse,
the stable replica and the churning ones. The tolerances are far below what a
leak per quorum change would add over these many changes (a thread, a socket
or a few objects each time), and above the noise of grpc's and gloo's pools.
"""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import psutil
import pytest
import torch
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from tests.waiting import wait_until
from torchft_like import Manager, ProcessGroupGloo
from torchft_like.manager.group.client import ManagerClient
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.server import ManagerServer

pytestmark = pytest.mark.timeout(120)
T = timedelta(seconds=10)


@dataclass(frozen=True)
class Usage:
    threads: int
    """Python threads."""
    os_threads: int
    """Every thread of the process, grpc's and gloo's C++ threads included."""
    fds: int
    rss_mb: float
    objects: int
    """Objects tracked by Python's garbage collector."""

    @staticmethod
    def now() -> Usage:
        gc.collect()
        proc = psutil.Process()
        return Usage(
            threading.active_count(),
            proc.num_threads(),
            proc.num_fds(),
            proc.memory_info().rss / 2**20,
            len(gc.get_objects()),
        )


def settled_usage(baseline: Usage, timeout_s: float = 10.0) -> Usage:
    """Usage once background teardown (gloo group droppers, closing sockets)
    has caught up: threads and fds back (as assert_flat wants them)."""
    usage = baseline

    def back() -> bool:
        nonlocal usage
        usage = Usage.now()
        return (
            usage.threads <= baseline.threads
            and usage.os_threads <= baseline.os_threads + 2
            and usage.fds <= baseline.fds + 2
        )

    wait_until(back, timeout_s, lambda: f"threads and fds back to {baseline}; at the end {usage}")
    return usage


def assert_flat(before: Usage, after: Usage, rss_mb: float, objects: int) -> None:
    report = f"after warm-up {before}, at the end {after}"
    print(report)  # shown with -s or on failure
    assert after.threads <= before.threads, report
    assert after.os_threads <= before.os_threads + 2, report
    assert after.fds <= before.fds + 2, report
    assert after.rss_mb - before.rss_mb < rss_mb, report
    assert after.objects - before.objects < objects, report


# ---- lighthouse and ManagerServer -----------------------------------------------


def test_hundreds_of_quorum_changes_leave_lighthouse_and_manager_server_usage_flat():
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=2000
    )

    def server(name: str) -> ManagerServer:
        return ManagerServer(
            replica_id=name,
            lighthouse_addr=lighthouse.address(),
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr=f"{name}:1",
            world_size=1,
        )

    def waiting(replica_id: str) -> bool:
        return any(
            r["waiting"] for r in lighthouse.status()["replicas"] if r["replica_id"] == replica_id
        )

    stable = server("stable")
    stable_client = ManagerClient(stable.address())
    quorum_ids: set[int] = set()

    def join_and_leave(i: int, pool: ThreadPoolExecutor) -> None:
        """One replica joins the stable one (a new quorum), then leaves (another)."""
        name = f"churn{i}"
        churn = server(name)
        churn_client = ManagerClient(churn.address())
        try:
            joined = pool.submit(churn_client.quorum, QuorumRequest(0, i), T)
            # The stable replica asks second, or its fast quorum would leave the newcomer out.
            wait_until(lambda: waiting(name), 10, f"{name} to wait at the lighthouse")
            both = stable_client.quorum(QuorumRequest(0, i), T)
            assert (
                both.replica_world_size == 2 and joined.result(timeout=10).replica_world_size == 2
            )
            quorum_ids.add(both.quorum_id)
        finally:
            churn_client.close()
            churn.shutdown()
        alone = stable_client.quorum(QuorumRequest(0, i), T)
        assert alone.replica_world_size == 1
        quorum_ids.add(alone.quorum_id)

    try:
        with ThreadPoolExecutor(1) as pool:
            for i in range(20):
                join_and_leave(i, pool)
            before = Usage.now()
            for i in range(20, 220):
                join_and_leave(i, pool)
            after = settled_usage(before)
        assert len(quorum_ids) == 2 * 220  # every join and every leave was a new quorum
        # The lighthouse forgot every replica that left; the server kept no vote round.
        assert [r["replica_id"] for r in lighthouse.status()["replicas"]] == ["stable"]
        assert not stable._votes
        assert_flat(before, after, rss_mb=8, objects=1000)
    finally:
        stable_client.close()
        stable.shutdown()
        lighthouse.shutdown()


# ---- Manager with real gloo ---------------------------------------------------


def test_a_manager_reconfiguring_gloo_on_each_quorum_change_keeps_usage_flat():
    """A stable Manager trains while replica groups join (and heal from it over
    HTTP) and leave; each change reconfigures its gloo group."""
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=2000
    )

    def manager(name: str, store: TCPStore) -> Manager:
        weights = torch.zeros(16)
        return Manager(
            pg=ProcessGroupGloo(timeout=T),
            load_state_dict=lambda sd: weights.copy_(sd["w"]),
            state_dict=lambda: {"w": weights},
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=store.port,
            lighthouse_addr=lighthouse.address(),
            replica_id=name,
            hostname="127.0.0.1",
            timeout=T,
            quorum_timeout=T,
            connect_timeout=T,
        )

    def step(m: Manager) -> tuple[bool, int]:
        m.start_quorum()
        m.allreduce(torch.ones(16)).wait()
        return m.should_commit(), m.num_participants()

    stop = threading.Event()
    quorum_ids: set[int] = set()
    stable_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stable = manager("stable", stable_store)

    def train_stable() -> None:
        while not stop.is_set():
            step(stable)
            quorum_ids.add(stable.quorum_id())

    def join_and_leave(i: int) -> None:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        churn = manager(f"churn{i}", store)
        try:
            for _ in range(100):
                committed, participants = step(churn)
                if committed and participants == 2:
                    break
            else:
                raise AssertionError(f"churn{i} never committed a step with the stable group")
        finally:
            churn.shutdown()

    trainer = threading.Thread(target=train_stable, name="stable-trainer")
    trainer.start()
    try:
        for i in range(3):
            join_and_leave(i)
        before = Usage.now()
        ids_before = len(quorum_ids)
        for i in range(3, 33):
            join_and_leave(i)
        after = settled_usage(before)
        assert len(quorum_ids) - ids_before >= 2 * 30 - 2  # a join and a leave each
        assert_flat(before, after, rss_mb=16, objects=3000)
    finally:
        stop.set()
        trainer.join(timeout=30)
        stable.shutdown()
        lighthouse.shutdown()
    assert not trainer.is_alive()
