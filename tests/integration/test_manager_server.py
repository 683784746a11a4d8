"""ManagerServer with a real lighthouse: ranks of a group as threads."""

from __future__ import annotations

import inspect
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from lighthouse import (
    LighthouseClient,
    LighthouseServer,
    LighthouseUnavailableError,
    QuorumError,
    QuorumTimeoutError,
)
from torchft_like.manager.group.client import (
    LocalManagerClient,
    ManagerClient,
    ManagerClientProtocol,
)
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.server import ManagerServer

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=20)


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    yield server
    server.shutdown()


@pytest.fixture
def make_group(lighthouse):
    servers = []

    def make(name: str, world_size: int, **kwargs) -> ManagerServer:
        server = ManagerServer(
            replica_id=name,
            lighthouse_addr=lighthouse.address(),
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr=f"{name}-store:1234",
            world_size=world_size,
            **kwargs,
        )
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.shutdown()


def ask(server: ManagerServer, group_rank: int, step: int, metadata: str = ""):
    request = QuorumRequest(group_rank=group_rank, step=step, checkpoint_metadata=metadata)
    return ManagerClient(server.address()).quorum(request, T)


def test_two_groups_of_two_ranks_get_one_quorum_with_per_rank_views(make_group):
    a, b = make_group("a", 2), make_group("b", 2)
    with ThreadPoolExecutor(4) as pool:
        futures = {
            (name, rank): pool.submit(ask, server, rank, step, f"ckpt-{name}-{rank}")
            for name, server, step in (("a", a, 3), ("b", b, 1))
            for rank in range(2)
        }
        results = {key: f.result() for key, f in futures.items()}
    assert len({r.quorum_id for r in results.values()}) == 1
    assert results[("a", 0)].replica_rank == 0 and results[("b", 1)].replica_rank == 1
    assert results[("b", 0)].heal and results[("b", 0)].recover_src_manager_address == a.address()
    assert results[("a", 1)].recover_dst_replica_ranks == (1,)
    assert results[("a", 0)].store_address == "a-store:1234"
    # The source's metadata for each rank is what that rank registered.
    client = ManagerClient(a.address())
    assert client.checkpoint_metadata(1, T) == "ckpt-a-1"


def test_the_group_asks_the_lighthouse_only_once_every_rank_asked(make_group):
    a, b = make_group("a", 2), make_group("b", 1)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(ask, a, 0, 0)
        other_group = pool.submit(ask, b, 0, 0)
        time.sleep(0.5)  # a window in which neither may be answered: a's rank 1 has not asked
        assert not first.done() and not other_group.done()
        pool.submit(ask, a, 1, 0).result()
        assert first.result().quorum_id == other_group.result().quorum_id


def test_commit_needs_every_rank_to_vote_yes(make_group):
    a = make_group("a", 3)
    client = ManagerClient(a.address())
    with ThreadPoolExecutor(3) as pool:
        yes = [pool.submit(client.should_commit, r, 5, True, T) for r in range(3)]
        assert all(f.result() for f in yes)
        mixed = [pool.submit(client.should_commit, r, 6, r != 1, T) for r in range(3)]
        assert not any(f.result() for f in mixed)


def test_a_group_of_one_rank_decides_its_vote_in_process_the_same_as_over_grpc(make_group):
    # The in-process client of a 1-rank group does not hop onto the loop;
    # its answers and errors must match the gRPC path's.
    a = make_group("a", 1)
    for client in (LocalManagerClient(a), ManagerClient(a.address())):
        assert client.should_commit(0, 3, True, T) is True
        assert client.should_commit(0, 4, False, T) is False
        with pytest.raises(ValueError, match=r"group_rank \(1\) must be in \[0, 1\)"):
            client.should_commit(1, 5, True, T)


def test_unknown_rank_and_missing_metadata_are_clear_errors(make_group):
    a = make_group("a", 2)
    client = ManagerClient(a.address())
    with pytest.raises(ValueError, match=r"group_rank \(7\) must be in \[0, 2\)"):
        client.should_commit(7, 0, True, T)
    with pytest.raises(QuorumError, match="group rank 1 of a has not asked for a quorum"):
        client.checkpoint_metadata(1, T)


def test_the_incoming_deadline_bounds_the_wait(make_group):
    a = make_group("a", 2)
    start = time.monotonic()
    with pytest.raises(QuorumTimeoutError):
        ManagerClient(a.address()).quorum(QuorumRequest(0, 0), timedelta(seconds=0.5))
    assert time.monotonic() - start < 3


def test_a_manager_server_without_a_lighthouse_fails_fast_naming_it():
    start = time.monotonic()
    with pytest.raises(LighthouseUnavailableError, match="127.0.0.1:1"):
        ManagerServer(
            replica_id="lonely",
            lighthouse_addr="http://127.0.0.1:1",
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr="x:1",
            world_size=1,
            connect_timeout=timedelta(seconds=0.5),
        )
    assert time.monotonic() - start < 3


def test_a_lost_lighthouse_reaches_the_ranks_at_the_quorum_deadline(lighthouse, make_group):
    a = make_group("a", 1, connect_timeout=timedelta(seconds=0.5), quorum_retries=2)
    lighthouse.shutdown()
    with pytest.raises(QuorumError, match=lighthouse.address().split("//")[1]):
        ManagerClient(a.address()).quorum(QuorumRequest(0, 0), timedelta(seconds=2))


def test_a_stalled_quorum_tells_every_rank_who_is_missing_and_why(lighthouse, make_group):
    """Rank 0 calls its server in process, rank 1 over gRPC; both hear the
    lighthouse's reason, which names the healthy replica that did not join."""
    a = make_group("a", 2)
    peer = make_group("peer", 1)  # heartbeats, never asks for a quorum
    del peer
    short = timedelta(seconds=1.5)
    clients = [LocalManagerClient(a), ManagerClient(a.address())]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(clients[r].quorum, QuorumRequest(r, 0), short) for r in range(2)]
        for rank, future in enumerate(futures):
            with pytest.raises(QuorumTimeoutError) as e:
                future.result(timeout=10)
            text = str(e.value)
            assert "min_replicas is 2" in text, f"rank {rank}: {text}"
            assert "healthy, not joined: peer" in text, f"rank {rank}: {text}"


def test_a_rank_that_never_asks_is_named_to_the_ranks_that_did(make_group):
    a = make_group("a", 3)
    short = timedelta(seconds=1)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ask_within, a, r, short) for r in (0, 2)]
        for future in futures:
            with pytest.raises(QuorumTimeoutError, match=r"group ranks \[1\] did not ask"):
                future.result(timeout=10)


def test_a_direct_lighthouse_call_hears_the_reason_not_a_bare_deadline(lighthouse):
    client = LighthouseClient(lighthouse.address())
    try:
        with pytest.raises(QuorumTimeoutError, match="waiting for replicas: 1 joined"):
            client.quorum("alone", timedelta(seconds=1))
    finally:
        client.close()


def ask_within(server: ManagerServer, group_rank: int, timeout: timedelta):
    return ManagerClient(server.address()).quorum(QuorumRequest(group_rank, 0), timeout)


@pytest.mark.parametrize("client_kind", [ManagerClient, LocalManagerClient])
def test_both_clients_honour_the_protocol_with_the_same_signatures(client_kind):
    for name, member in vars(ManagerClientProtocol).items():
        if name.startswith("_") or not callable(member):
            continue
        assert hasattr(client_kind, name), f"{client_kind.__name__} lacks {name}"
        ours = list(inspect.signature(getattr(client_kind, name)).parameters)
        assert ours == list(inspect.signature(member).parameters), name


KILL_IN_PROCESS = """
import sys
from lighthouse import LighthouseServer
from torchft_like.manager.group.client import LocalManagerClient
from torchft_like.manager.group.server import ManagerServer
lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
server = ManagerServer(replica_id="g:1", lighthouse_addr=lighthouse.address(),
                       hostname="127.0.0.1", bind="127.0.0.1:0", store_addr="x:1", world_size=1)
LocalManagerClient(server).kill("asked by the test")
import time; time.sleep(10)
sys.exit(0)
"""


def test_the_in_process_client_can_kill_its_group_too():
    proc = subprocess.run(
        [sys.executable, "-c", KILL_IN_PROCESS], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "killed by request: asked by the test" in proc.stderr
