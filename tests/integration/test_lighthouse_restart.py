"""A lighthouse restarted on the same port while groups ask for quorums: the
ManagerServers wait out the outage, reconnect, and get a new, larger id."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from lighthouse import LighthouseServer
from torchft_like.group_quorum import QuorumRequest
from torchft_like.manager_client import ManagerClient
from torchft_like.manager_server import ManagerServer

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=20)


@pytest.fixture
def servers():
    made = []
    yield made
    for server in reversed(made):
        server.shutdown()


def ask(server: ManagerServer, step: int):
    return ManagerClient(server.address()).quorum(QuorumRequest(group_rank=0, step=step), T)


def test_groups_waiting_through_a_lighthouse_restart_get_the_next_quorum(servers):
    first = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500)
    servers.append(first)
    address = first.address()
    bind = address.split("//")[1]
    groups = [
        ManagerServer(
            replica_id=name,
            lighthouse_addr=address,
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr=f"{name}-store:1",
            world_size=1,
            connect_timeout=timedelta(seconds=1),
        )
        for name in ("a", "b")
    ]
    servers.extend(groups)
    with ThreadPoolExecutor(2) as pool:
        before = [r.quorum_id for r in pool.map(ask, groups, [5, 5])]
        first.shutdown()
        waiting = [pool.submit(ask, g, 6) for g in groups]
        time.sleep(1.5)  # an outage longer than one connect attempt
        assert not any(f.done() for f in waiting), "a quorum failed while the lighthouse was down"
        servers.append(LighthouseServer(bind=bind, min_replicas=2, join_timeout_ms=500))
        after = [f.result(timeout=30) for f in waiting]
    assert len(set(before)) == 1 and len({r.quorum_id for r in after}) == 1
    assert after[0].quorum_id > before[0], "a restarted lighthouse repeated a quorum id"
    assert [r.replica_world_size for r in after] == [2, 2]
    assert not any(r.heal for r in after)
