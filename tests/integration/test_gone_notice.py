"""Gone notices end to end in one process: a real lighthouse tells the live
ManagerServer of a quorum that its other member's process is gone
(lighthouse.core.gone), and rank 0 passes it to the group's other ranks through
the group's store (torchft_like.manager.gone_watch)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from tests.waiting import wait_until
from torchft_like._work import FutureWork
from torchft_like.collectives import InOrderCollectives
from torchft_like.manager.config import resolve_config
from torchft_like.manager.gone_watch import MemberGoneError, StepBreaker
from torchft_like.manager.group.client import LocalManagerClient
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.server import ManagerServer
from torchft_like.process_group import ProcessGroupGloo

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=20)


def test_the_live_member_hears_at_once_that_the_other_died_and_nothing_else():
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, heartbeat_timeout_ms=5000)
    servers = [
        ManagerServer(
            replica_id=f"g{i}:x",
            lighthouse_addr=lighthouse.address(),
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr="127.0.0.1:1",
            world_size=1,
        )  # fmt: skip
        for i in range(2)
    ]
    heard: list[tuple[int, tuple[str, ...]]] = []
    servers[0].add_gone_listener(lambda q, gone: heard.append((q, gone)))
    try:
        with ThreadPoolExecutor(2) as pool:
            asks = [
                pool.submit(LocalManagerClient(s).quorum, QuorumRequest(0, 0), T) for s in servers
            ]
            quorum_id = asks[0].result().quorum_id
        # A notice (as the lighthouse client hands it over) about another
        # quorum is dropped. (The group took in its view, not the member
        # list: our lighthouse sends a notice only to the gone members'
        # quorum, so its names are not filtered again; tests/unit/test_gone.py.)
        servers[0].session.client.on_gone(quorum_id - 1, ("g1:x",))
        assert heard == []
        start = time.monotonic()
        servers[1].shutdown(leave=False)  # its stream closes, as when its process dies
        wait_until(lambda: heard != [])
        assert heard == [(quorum_id, ("g1:x",))]
        # Well before the 5 s heartbeat timeout: the closed stream tells.
        assert time.monotonic() - start < 2.0
    finally:
        for server in servers:
            server.shutdown()
        lighthouse.shutdown()


class _Server:
    """What StepBreaker needs of rank 0's ManagerServer."""

    def __init__(self) -> None:
        self.listeners: list[Any] = []

    def add_gone_listener(self, listener: Any) -> None:
        self.listeners.append(listener)


class _Stuck:
    """A process group whose allreduce never completes."""

    def __init__(self) -> None:
        self.aborted = threading.Event()

    def allreduce(self, tensors: list[torch.Tensor], op: Any) -> Any:
        return FutureWork(torch.futures.Future())

    def abort(self) -> None:
        self.aborted.set()


def test_rank_0_passes_a_notice_to_the_other_ranks_through_the_store():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    server, watches, groups, errors = _Server(), [], [], []
    try:
        for rank in range(2):
            config = resolve_config(
                rank=rank, world_size=2, store_addr="127.0.0.1", store_port=store.port,
                lighthouse_addr="http://127.0.0.1:1", environ={},
            )  # fmt: skip
            colls, pg = InOrderCollectives(), _Stuck()
            watch = StepBreaker(
                config, store, "g:x", server if rank == 0 else None, colls, pg,
                _logger(rank),
            )  # fmt: skip
            watch.new_step()
            watch.quorum_applied(7)
            colls.allreduce(torch.ones(2), pg, False, None, errors.append)
            watches.append(watch)
            groups.append(pg)
        (listener,) = server.listeners
        listener(7, ("c:y",))
        for pg in groups:
            assert pg.aborted.wait(10), "a rank's collective was not aborted"
        assert len(errors) == 2 and all("quorum 7" in str(e) for e in errors)
    finally:
        watcher = watches[1]._watcher if len(watches) > 1 else None
        for watch in watches:
            watch.close()
    assert watcher is not None and not watcher.is_alive(), "close() leaves no thread behind"


def _logger(rank: int) -> logging.LoggerAdapter[logging.Logger]:
    return logging.LoggerAdapter(logging.getLogger(f"test.rank{rank}"), {})


def test_a_notice_ends_a_rank_s_process_group_setup_for_that_quorum_at_once():
    """Joining a quorum whose member died waits on the member's rendezvous key
    (or its store) up to the collective timeout; a notice ends the wait, and
    the group it was joining is never installed."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    config = resolve_config(
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr="http://127.0.0.1:1",
        environ={},
    )
    server = _Server()
    pg = ProcessGroupGloo(timeout=timedelta(seconds=3))
    watch = StepBreaker(config, store, "g:x", server, InOrderCollectives(), pg, _logger(0))
    (listener,) = server.listeners
    try:
        # Rank 0 of 2: the other member never comes (its process died).
        threading.Timer(0.3, listener, args=(8, ("dead:z",))).start()
        start = time.monotonic()
        with pytest.raises(MemberGoneError, match=r"quorum 8: .*dead:z.*process group setup"):
            watch.join(8, f"127.0.0.1:{store.port}/q8", "g:x", 0, 2)
        assert time.monotonic() - start < 2.0, "the setup waited on past the notice"
        # A notice heard before the setup begins ends it before it starts.
        with pytest.raises(MemberGoneError):
            watch.unless_gone(8, lambda: time.sleep(60), "process group setup")
        # The abandoned join ends at its own timeout (3 s) and installs nothing.
        wait_until(
            lambda: not any(t.name == "torchft_process_group_setup" for t in threading.enumerate()),
            10,
            "the abandoned join to time out",
        )
        with pytest.raises(RuntimeError, match="aborted"):
            pg.allreduce([torch.ones(1)], dist.AllreduceOptions()).wait()
        # A setup no notice concerns returns, or raises its own error.
        watch.unless_gone(9, lambda: None, "process group setup")
        with pytest.raises(ValueError, match="own"):
            watch.unless_gone(9, functools.partial(_raise, ValueError("its own")), "setup")
    finally:
        watch.close()


def _raise(error: Exception) -> None:
    raise error
