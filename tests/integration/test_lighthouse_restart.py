"""A lighthouse restarted on the same port while groups ask for quorums: the
ManagerServers wait out the outage, reconnect, and get a new, larger id; with
its --state-file, it answers at once with the same id and keeps the job's
high-water mark."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from lighthouse import FreshStartRefusedError, LighthouseServer
from tests.procs import PYTHON, wait_for_line
from tests.waiting import wait_until
from tools.procs import kill_tree
from torchft_like.manager.group.client import ManagerClient
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.server import ManagerServer

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


# ---- a lighthouse process SIGKILLed and restarted with its --state-file ------


def start_lighthouse(children, port: int, state_file, *extra: str):
    """A lighthouse process on `port` (0: any); returns it, its address and when it listened."""
    started: list[tuple] = []
    failures: list[str] = []

    def start() -> bool:  # tried again: the port may still be held a moment after a SIGKILL
        proc = children.spawn(
            [PYTHON, "-m", "lighthouse", "--min-replicas", "1", "--bind", f"127.0.0.1:{port}",
             "--http-bind", "", "--state-file", str(state_file), *extra]
        )  # fmt: skip
        try:
            match = wait_for_line(proc, r"lighthouse listening on (http://\S+)", 15)
        except AssertionError as e:
            kill_tree(proc.pid)
            failures.append(str(e))
            return False
        started.append((proc, match.group(1), time.monotonic()))
        return True

    wait_until(start, 20, lambda: f"a lighthouse on port {port}; the last try: {failures[-1]}")
    return started[0]


def group(servers: list, name: str, address: str) -> ManagerServer:
    server = ManagerServer(
        replica_id=name,
        lighthouse_addr=address,
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr=f"{name}-store:1",
        world_size=1,
        connect_timeout=timedelta(seconds=5),
    )
    servers.append(server)
    return server


def test_a_lighthouse_restarted_with_its_state_file_answers_at_once_with_the_same_quorum(
    children, servers, tmp_path
):
    """Its last quorum's members are all back: no wait for stragglers (the
    default heartbeat timeout would make it wait 2.5 s), the same id (the
    groups keep their process groups), and the mark is kept."""
    state = tmp_path / "lighthouse.json"
    lighthouse, address, _ = start_lighthouse(children, 0, state)
    port = int(address.rsplit(":", 1)[1])
    groups = [group(servers, name, address) for name in ("a", "b")]
    with ThreadPoolExecutor(2) as pool:
        before = [r.quorum_id for r in pool.map(ask, groups, [5, 5])]
        kill_tree(lighthouse.pid)
        waiting = [pool.submit(ask, g, 6) for g in groups]
        time.sleep(1.0)  # an outage over which no quorum may fail
        assert not any(f.done() for f in waiting)
        _, _, listening = start_lighthouse(children, port, state)
        after = [f.result(timeout=30) for f in waiting]
        answered_s = time.monotonic() - listening
    assert answered_s < 1.0, f"first quorum {answered_s:.2f} s after the restart"
    assert {r.quorum_id for r in after} == set(before), "a new id: the groups reconfigure"
    assert [r.replica_world_size for r in after] == [2, 2] and not any(r.heal for r in after)
    assert json.loads(state.read_text())["high_water_step"] == 6


def test_the_mark_outlives_a_restart_and_a_fresh_start_needs_the_flag(children, servers, tmp_path):
    state = tmp_path / "lighthouse.json"
    lighthouse, address, _ = start_lighthouse(children, 0, state)
    port = int(address.rsplit(":", 1)[1])
    ask(group(servers, "a", address), 9)
    servers.pop().shutdown()  # the only group that held the job's state is gone
    kill_tree(lighthouse.pid)
    lighthouse, _, _ = start_lighthouse(children, port, state)
    # A newcomer at step 0 and no group that holds the job's state: it waits,
    # and hears why (the lighthouse answers after FRESH_START_HOLD_S).
    fresh = group(servers, "b", address)
    start = time.monotonic()
    with pytest.raises(FreshStartRefusedError, match="already committed step 9") as refused:
        ManagerClient(fresh.address()).quorum(
            QuorumRequest(group_rank=0, step=0), timedelta(seconds=5)
        )
    assert time.monotonic() - start >= 4.5, "it must wait, not fail at once"
    assert "--allow-fresh-start" in str(refused.value)
    kill_tree(lighthouse.pid)
    start_lighthouse(children, port, state, "--allow-fresh-start")
    assert ask(fresh, 0).replica_world_size == 1  # deliberate: trains from step 0
