"""The real lighthouse server in this process, with clients in threads."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from lighthouse import (
    LighthouseClient,
    LighthouseServer,
    LighthouseUnavailableError,
    QuorumTimeoutError,
)
from lighthouse.rpc.h2.limits import LIMITS
from tests.waiting import wait_until
from tools import h2_attacks
from tools import h2_peer as h2

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=20)


@pytest.fixture
def make_server():
    servers = []

    def make(**kwargs) -> LighthouseServer:
        kwargs.setdefault("bind", "127.0.0.1:0")
        server = LighthouseServer(**kwargs)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.shutdown()


def join_all(addr: str, replica_ids: list[str], timeout: timedelta = T, **kwargs):
    """Each replica asks for a quorum from its own thread and heartbeats every
    100 ms meanwhile, as a ManagerServer does."""

    def one(rid):
        client = LighthouseClient(addr, connect_timeout=timedelta(seconds=5))
        done = threading.Event()

        def beat():
            while not done.wait(0.1):
                client.heartbeat(rid)

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        try:
            return client.quorum(rid, timeout, **kwargs)
        finally:
            done.set()
            beater.join(5)
            client.close()

    with ThreadPoolExecutor(len(replica_ids)) as pool:
        return list(pool.map(one, replica_ids))


def test_clients_in_threads_all_get_the_same_quorum(make_server):
    server = make_server(min_replicas=3)
    quorums = join_all(server.address(), ["a", "b", "c"])
    assert len({q.quorum_id for q in quorums}) == 1
    assert all(q.replica_ids() == ("a", "b", "c") for q in quorums)
    assert quorums[0].quorum_id >= int(time.time() * 1000) - 60_000


def test_quorum_id_stays_for_the_same_members_and_grows_on_change(make_server):
    server = make_server(min_replicas=2)
    first = join_all(server.address(), ["a", "b"])[0]
    second = join_all(server.address(), ["a", "b"])[0]
    assert second.quorum_id == first.quorum_id
    third = join_all(server.address(), ["a", "b"], commit_failures=1)[0]
    assert third.quorum_id > second.quorum_id


def test_a_client_that_stops_heartbeating_is_dropped_after_the_timeout(make_server):
    server = make_server(min_replicas=2, heartbeat_timeout_ms=500, join_timeout_ms=60_000)
    client = LighthouseClient(server.address())
    for rid in ["a", "b", "c"]:
        client.heartbeat(rid)  # all healthy, so the first quorum waits for all three
    assert join_all(server.address(), ["a", "b", "c"])[0].replica_ids() == ("a", "b", "c")
    start = time.monotonic()
    # c is silent now; a and b wait for it only until its heartbeat expires.
    quorum = join_all(server.address(), ["a", "b"])[0]
    elapsed = time.monotonic() - start
    assert quorum.replica_ids() == ("a", "b")
    assert 0.3 < elapsed < 5


def test_a_cancelled_quorum_call_is_not_included(make_server):
    server = make_server(min_replicas=2, join_timeout_ms=300, heartbeat_timeout_ms=5000)
    client = LighthouseClient(server.address())
    with pytest.raises(QuorumTimeoutError, match="lighthouse"):
        client.quorum("gone", timedelta(seconds=0.3))
    quorum = join_all(server.address(), ["b", "c"])[0]
    assert quorum.replica_ids() == ("b", "c")
    client.close()


def test_a_caller_left_out_keeps_waiting_for_the_next_quorum(make_server):
    server = make_server(min_replicas=1)
    join_all(server.address(), ["a"])
    result = {}

    def late():
        result["q"] = LighthouseClient(server.address()).quorum("b", T, shrink_only=False)

    # "a" asks shrink_only, so "b" is left out of the first quorum and gets the next.
    waiter = threading.Thread(target=late)
    waiter.start()
    wait_until(
        lambda: any(r["waiting"] for r in server.status()["replicas"] if r["replica_id"] == "b"),
        10,
        "b to wait at the lighthouse",
    )
    first = join_all(server.address(), ["a"], shrink_only=True)[0]
    assert first.replica_ids() == ("a",)
    second = join_all(server.address(), ["a"])[0]
    waiter.join(10)
    assert result["q"].replica_ids() == ("a", "b") == second.replica_ids()


def test_a_restarted_lighthouse_on_the_same_port_issues_larger_ids(make_server):
    server = make_server(min_replicas=1)
    address = server.address()
    first = join_all(address, ["a"])[0]
    server.shutdown()
    port = address.rsplit(":", 1)[1]
    restarted = make_server(min_replicas=1, bind=f"127.0.0.1:{port}")
    second = join_all(restarted.address(), ["b"])[0]
    assert second.quorum_id > first.quorum_id


def test_an_empty_replica_id_is_refused_naming_the_field(make_server):
    server = make_server(min_replicas=1)
    with pytest.raises(ValueError, match="replica_id"):
        LighthouseClient(server.address()).quorum("", T)


def test_an_unreachable_lighthouse_is_reported_within_the_connect_timeout():
    client = LighthouseClient("http://127.0.0.1:1", connect_timeout=timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(LighthouseUnavailableError, match="127.0.0.1:1"):
        client.quorum("a", T)
    assert time.monotonic() - start < 3


def test_a_port_in_use_is_a_clear_error(make_server):
    server = make_server(min_replicas=1)
    port = server.address().rsplit(":", 1)[1]
    with pytest.raises(OSError, match="port is in use"):
        LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1)


def test_status_page_and_metrics_show_the_quorum(make_server):
    server = make_server(min_replicas=2, http_bind="127.0.0.1:0")
    quorum = join_all(server.address(), ["a", "b"], step=7)[0]
    with urllib.request.urlopen(server.http_address() + "/status.json", timeout=5) as r:
        status = json.load(r)
    assert status["quorum_id"] == quorum.quorum_id
    assert [(r["replica_id"], r["step"], r["healthy"]) for r in status["replicas"]] == [
        ("a", 7, True),
        ("b", 7, True),
    ]
    with urllib.request.urlopen(server.http_address() + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'torchft_lighthouse_quorums_issued_total{job="default"} 1.0' in metrics
    assert 'torchft_lighthouse_quorum_size{job="default"} 2.0' in metrics
    with urllib.request.urlopen(server.http_address() + "/", timeout=5) as r:
        page = r.read().decode()
    assert 'http-equiv="refresh"' in page and str(quorum.quorum_id) in page


def test_the_metrics_count_connections_closed_for_a_flood_by_kind(make_server):
    server = make_server(min_replicas=1, http_bind="127.0.0.1:0")
    budget = h2.Budget(4 * h2.MB, 5.0)
    h2_attacks.priority_flood(server.address(), budget).close()

    def calmed() -> bool:
        with urllib.request.urlopen(server.http_address() + "/metrics", timeout=5) as r:
            return 'torchft_lighthouse_http2_calmed_total{kind="priority"} 1.0' in r.read().decode()

    wait_until(calmed, 10, "the flood counted in /metrics")


def test_a_stream_of_heartbeats_faster_than_its_rate_is_ended(make_server):
    """Heartbeats as fast as flow control allows are work taken from every
    group: past Limits.stream_message_rate the call ends RESOURCE_EXHAUSTED,
    and the lighthouse serves on."""
    server = make_server(min_replicas=1)
    peer = h2.Peer(server.address(), h2.Budget(8 * h2.MB, 10.0))
    stream_id = peer.open(h2.request_headers(peer.authority, h2.method("HeartbeatStream")))
    burst = int(LIMITS.stream_message_rate[0])
    peer.send_data(stream_id, h2.heartbeat_message("fast") * (2 * burst))
    peer.wait_ended(stream_id)
    status = dict(peer.answers.get(stream_id, []))
    assert status.get("grpc-status") == "8" and "messages" in status.get("grpc-message", "")
    peer.close()
    client = LighthouseClient(server.address())
    assert client.quorum("healthy", timedelta(seconds=10)).quorum_id >= 1


def test_a_replica_that_leaves_lets_the_others_go_on_at_once(make_server):
    server = make_server(min_replicas=1, heartbeat_timeout_ms=30_000, join_timeout_ms=30_000)
    client = LighthouseClient(server.address())
    for rid in ["a", "b"]:
        client.heartbeat(rid)
    join_all(server.address(), ["a", "b"])
    client.leave("b")
    start = time.monotonic()
    quorum = join_all(server.address(), ["a"])[0]
    assert quorum.replica_ids() == ("a",)
    assert time.monotonic() - start < 2  # not the 30 s heartbeat or join timeout


def test_a_healthy_job_logs_one_line_per_quorum_change_and_a_calm_status_mid_step(
    make_server, caplog
):
    """Each step one group asks before the other: that wait is ordinary, so it
    is neither logged at INFO nor shown on the status page as an alarm."""
    server = make_server(min_replicas=2)
    clients = {rid: LighthouseClient(server.address(), connect_timeout=T) for rid in "ab"}
    try:
        for rid, client in clients.items():
            client.heartbeat(rid)
        with caplog.at_level(logging.INFO, logger="lighthouse.shell.server"):
            with ThreadPoolExecutor(1) as pool:
                for _ in range(10):
                    first = pool.submit(clients["a"].quorum, "a", T)
                    wait_until(lambda: any(r["waiting"] for r in server.status()["replicas"]))
                    # The call's decision may wait a few ms (decide_soon's
                    # batching); until then the page still shows the last issue.
                    wait_until(lambda: not server.status()["summary"].startswith("quorum issued"))
                    summary = server.status()["summary"]
                    assert summary.startswith("step in progress: waiting for 1 of 2"), summary
                    assert "split brain" not in summary
                    second = clients["b"].quorum("b", T)
                    assert first.result(timeout=20).quorum_id == second.quorum_id
        assert server.status()["summary"].startswith("quorum issued: ")
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert len([m for m in lines if " issued (" in m]) == 1, lines
        assert not [m for m in lines if "quorum status" in m], lines
    finally:
        for client in clients.values():
            client.close()


def test_a_stalled_quorum_is_logged_once_with_its_reason(make_server, caplog, monkeypatch):
    from lighthouse.core import membership

    monkeypatch.setattr(
        membership,
        "waiting_report",
        functools.partial(membership.waiting_report, stall_after_s=0.2),
    )
    server = make_server(min_replicas=2, quorum_tick_ms=20)
    client = LighthouseClient(server.address(), connect_timeout=T)
    try:
        client.heartbeat("b")
        with caplog.at_level(logging.INFO, logger="lighthouse.shell.server"):
            with pytest.raises(QuorumTimeoutError, match="no majority|min_replicas"):
                client.quorum("a", timedelta(seconds=1))
        stalls = [r.getMessage() for r in caplog.records if "quorum status" in r.getMessage()]
        assert len(stalls) == 1, stalls
        assert "stalled for" in stalls[0]
    finally:
        client.close()


def test_a_group_that_asks_for_its_view_gets_its_ranks_shares_and_no_member_list(make_server):
    """Over real gRPC: one member takes the member list, the other its view
    (two group ranks); the view is what the member list gives that member."""
    import asyncio

    from lighthouse.client import AsyncLighthouseClient
    from lighthouse.core.quorum import QuorumMember
    from lighthouse.core.views import compute_quorum_result

    server = make_server(min_replicas=2)

    async def ask_view():
        client = AsyncLighthouseClient(server.address(), timedelta(seconds=5))
        try:
            member = QuorumMember("viewer:1", "http://v:1", "v:2", step=3, world_size=2)
            return await client.quorum_view(member, T, init_sync=False)
        finally:
            await client.close()

    with ThreadPoolExecutor(1) as pool:
        lister = pool.submit(join_all, server.address(), ["lister:1"], step=3)
        quorum, views = asyncio.run(ask_view())
        full = lister.result(timeout=30)[0]
    assert quorum.participants == () and quorum.quorum_id == full.quorum_id
    assert full.replica_ids() == ("lister:1", "viewer:1")
    assert list(views) == [compute_quorum_result(full, "viewer:1", g, False) for g in range(2)]
