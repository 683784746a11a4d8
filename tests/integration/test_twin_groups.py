"""Two live replica groups with one name: the later one is refused by a real
lighthouse, over real gRPC, until the first is dead or has left."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lighthouse import DuplicateGroupError, LighthouseClient, LighthouseServer
from tests.waiting import wait_until
from torchft_like.manager.group.server import ManagerServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def lighthouse():
    # A long heartbeat timeout: only a Leave or a closed stream can release a name.
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=30_000)
    yield server
    server.shutdown()


@pytest.fixture
def make_server(lighthouse):
    servers = []

    def make(replica_id: str) -> ManagerServer:
        server = ManagerServer(
            replica_id=replica_id,
            lighthouse_addr=lighthouse.address(),
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr="127.0.0.1:1234",
            world_size=1,
        )
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.shutdown()


def test_a_second_group_with_a_live_groups_name_is_refused_naming_the_name(make_server):
    make_server("train_0:first")
    with pytest.raises(DuplicateGroupError) as refused:
        make_server("train_0:second")
    text = str(refused.value)
    assert "replica group 'train_0' is already live as train_0:first" in text
    assert "refusing train_0:second" in text
    make_server("train_1:other")  # another name is welcome


def test_a_refused_groups_quorum_call_is_refused_too(lighthouse, make_server):
    make_server("train_0:first")
    client = LighthouseClient(lighthouse.address())
    try:
        with pytest.raises(DuplicateGroupError, match="'train_0' is already live"):
            client.quorum("train_0:second", timedelta(seconds=10))
    finally:
        client.close()


@pytest.mark.parametrize("leave", [True, False], ids=["first left", "first died"])
def test_the_name_is_free_again_once_the_first_group_left_or_died(lighthouse, make_server, leave):
    first = make_server("train_0:first")
    with pytest.raises(DuplicateGroupError):
        make_server("train_0:second")
    # leave=False: its heartbeat stream just closes, as when its process dies.
    first.shutdown(leave=leave)
    # The stream's end reaches the lighthouse on its own loop, a moment later.
    wait_until(
        lambda: not any(r["healthy"] for r in lighthouse.status()["replicas"]),
        10,
        "the lighthouse to stop counting the first as live",
    )
    second = make_server("train_0:third")
    assert second.address()
