"""Many jobs on one real lighthouse in this process: apart, each with its rule
and secret, bounded, forgotten when idle, listed and kept across a restart.
Clients are real gRPC clients (ours and grpcio's), on both server runtimes."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import pytest

from lighthouse import LighthouseClient, LighthouseServer, QuorumError, QuorumTimeoutError
from lighthouse.rpc import auth
from lighthouse.rpc.address import url_to_target
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=15)
SA, SB, SG = "secret-of-job-a", "secret-of-job-b", "secret-of-the-lighthouse"


@pytest.fixture
def make_server():
    servers = []

    def make(**kwargs) -> LighthouseServer:
        kwargs.setdefault("bind", "127.0.0.1:0")
        kwargs.setdefault("min_replicas", 1)
        kwargs.setdefault("join_timeout_ms", 100)
        server = LighthouseServer(**kwargs)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.shutdown()


def join(addr: str, members: list[tuple[str, str]], secret=None, timeout=T):
    """Each (job, replica id) asks for a quorum from its own thread, its
    address naming its job, heartbeating meanwhile; returns the quorums."""

    def one(member):
        job, rid = member
        client = LighthouseClient(addr, timedelta(seconds=5), secret=secret, job_id=job)
        done = threading.Event()
        beater = threading.Thread(
            target=lambda: [client.heartbeat(rid) for _ in iter(lambda: done.wait(0.1), True)]
        )
        beater.start()
        try:
            return client.quorum(rid, timeout, address=f"{job}/{rid}")
        finally:
            done.set()
            beater.join(5)
            client.close()

    with ThreadPoolExecutor(len(members)) as pool:
        return list(pool.map(one, members))


def raw_call(addr: str, metadata, method="Heartbeat"):
    """One call with exactly this metadata (no client-side checks)."""
    channel = grpc.insecure_channel(url_to_target(addr, "test", "test"))
    try:
        stub = pb_grpc.LighthouseServiceStub(channel)
        request = pb.LighthouseHeartbeatRequest(replica_id="r0")
        return getattr(stub, method)(request, timeout=5, metadata=metadata)
    finally:
        channel.close()


def get(url: str, secret: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=auth.http_headers(secret))
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("rpc_server", ["lean", "grpcio"])
def test_two_jobs_with_the_same_replica_ids_never_meet(make_server, rpc_server):
    server = make_server(min_replicas=2, join_timeout_ms=5000, rpc_server=rpc_server)
    members = [("a", "r0"), ("a", "r1"), ("b", "r0"), ("b", "r1"), ("default", "r0")]
    quorums = join(server.address(), members[:4])
    for (job, _), quorum in zip(members, quorums):
        assert [m.address for m in quorum.participants] == [f"{job}/r0", f"{job}/r1"]
    assert quorums[0].quorum_id == quorums[1].quorum_id
    assert quorums[2].quorum_id == quorums[3].quorum_id
    # The default job's r0 is a third replica of that name: no twin refusal.
    client = LighthouseClient(server.address(), timedelta(seconds=5))
    client.heartbeat("r0")
    with pytest.raises(QuorumTimeoutError):  # alone in its job, which needs two
        client.quorum("r0", timedelta(seconds=0.5))
    client.close()


def test_a_job_rule_is_that_jobs_alone(make_server):
    server = make_server(job_rules={"big": {"min_replicas": 2}})
    (quorum,) = join(server.address(), [("small", "r0")])
    assert quorum.replica_ids() == ("r0",)
    with pytest.raises(QuorumTimeoutError) as e:
        join(server.address(), [("big", "r0")], timeout=timedelta(seconds=0.5))
    assert "r0" in str(e.value)


@pytest.mark.parametrize("rpc_server", ["lean", "grpcio"])
def test_a_jobs_secret_is_refused_in_another_job_and_no_secret_touches_either(
    make_server, rpc_server
):
    server = make_server(job_secrets={"a": SA, "b": SB}, rpc_server=rpc_server)
    addr = server.address()
    (quorum,) = join(addr, [("a", "r0")], secret=SA)
    assert quorum.replica_ids() == ("r0",)
    for secret, job in [(SB, "a"), (None, "a"), (SA, "b"), (None, "b")]:
        with pytest.raises(grpc.RpcError) as e:
            raw_call(addr, auth.metadata(secret, job))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        if job is not None:
            assert f"job {job!r}" in e.value.details()
    raw_call(addr, auth.metadata(None, "c"))  # an open job stays open
    raw_call(addr, auth.metadata(None, None))
    raw_call(addr, auth.metadata(SA, None))  # (the default job, open here, too)


def test_a_lighthouse_secret_guards_every_job_without_its_own(make_server):
    server = make_server(secret=SG, job_secrets={"a": SA})
    addr = server.address()
    raw_call(addr, auth.metadata(SG, "c"))
    raw_call(addr, auth.metadata(SG, None))
    for secret, job in [(None, "c"), (SA, "c"), (SG, "a")]:
        with pytest.raises(grpc.RpcError) as e:
            raw_call(addr, auth.metadata(secret, job))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "job, fix",
    [("a b", "holds a character"), ("x" * 65, "65 characters long"), ("", "is empty")],
)
def test_a_bad_job_id_is_refused_with_what_to_set(make_server, job, fix):
    server = make_server()
    with pytest.raises(grpc.RpcError) as e:
        raw_call(server.address(), (("torchft-job", job),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fix in e.value.details() and "TORCHFT_JOB_ID" in e.value.details()
    with pytest.raises(ValueError, match=fix):
        LighthouseClient(server.address(), job_id=job)


def test_jobs_and_members_are_bounded(make_server):
    server = make_server(max_jobs=3, max_members_per_job=2)
    addr = server.address()
    for job in ("a", "b"):
        raw_call(addr, auth.metadata(None, job))
    with pytest.raises(grpc.RpcError) as e:
        raw_call(addr, auth.metadata(None, "c"))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-jobs 3" in e.value.details()
    client = LighthouseClient(addr, timedelta(seconds=5), job_id="a")
    client.heartbeat("r1")
    with pytest.raises(QuorumError) as refused:
        client.heartbeat("r2")
    assert "--max-members-per-job 2" in str(refused.value)
    client.heartbeat("r0")  # one it knows
    client.close()


def test_the_replicas_of_every_job_together_are_bounded(make_server):
    server = make_server(max_members=3, max_members_per_job=2)
    clients = {job: LighthouseClient(server.address(), T, job_id=job) for job in ("a", "b")}
    clients["a"].heartbeat("r0")
    clients["a"].heartbeat("r1")
    clients["b"].heartbeat("r0")
    with pytest.raises(QuorumError) as refused:
        clients["b"].heartbeat("r1")
    assert "--max-members 3" in str(refused.value)
    clients["a"].leave("r0")  # its place comes back at the next sweep (each second)
    wait_until(lambda: try_heartbeat(clients["b"], "r1"), 10, "room for one more replica")
    for client in clients.values():
        client.close()


def try_heartbeat(client: LighthouseClient, replica_id: str) -> bool:
    try:
        client.heartbeat(replica_id)
        return True
    except QuorumError:
        return False


def test_an_idle_job_is_forgotten_and_its_memory_and_series_go(make_server):
    server = make_server(job_idle_s=0.3, max_jobs=2, http_bind="127.0.0.1:0")
    addr, page = server.address(), server.http_address()
    client = LighthouseClient(addr, timedelta(seconds=5), job_id="brief")
    client.quorum("r0", T)
    assert 'torchft_lighthouse_quorums_issued_total{job="brief"} 1.0' in get(page + "/metrics")[1]
    client.leave("r0")
    client.close()
    wait_until(lambda: "brief" not in server.jobs.by_id, 10, "the idle job to be forgotten")
    metrics = get(page + "/metrics")[1]
    assert 'job="brief"' not in metrics and "torchft_lighthouse_jobs 1.0" in metrics
    assert get(page + "/job/brief/status.json")[0] == 404
    raw_call(addr, auth.metadata(None, "next"))  # its place is free again
    assert "default" in server.jobs.by_id


def test_the_status_page_lists_the_jobs_and_a_protected_one_needs_its_secret(make_server):
    server = make_server(job_secrets={"a": SA}, http_bind="127.0.0.1:0")
    join(server.address(), [("a", "r0")], secret=SA)
    join(server.address(), [("b", "r0")])
    page = server.http_address()
    code, body = get(page + "/status.json")
    listed = {j["job"]: j for j in json.loads(body)["jobs"]}
    assert code == 200 and set(listed) == {"a", "b", "default"}
    assert listed["a"] == {"job": "a", "protected": True}
    assert listed["b"]["members"] == 1 and listed["b"]["quorum_id"] is not None
    code, body = get(page + "/job/a/status.json")
    assert code == 401 and "job 'a'" in body
    assert get(page + "/job/a/status.json", SB)[0] == 401
    code, body = get(page + "/job/a/status.json", SA)
    assert code == 200 and json.loads(body)["quorum_members"] == ["r0"]
    code, body = get(page + "/job/b/")
    assert code == 200 and "job b" in body and 'href="/job/a"' in body
    assert get(page + "/job/nope/status.json")[0] == 404
    metrics = get(page + "/metrics")[1]
    assert 'torchft_lighthouse_quorum_size{job="a"} 1.0' in metrics
    assert 'torchft_lighthouse_quorum_size{job="b"} 1.0' in metrics


def test_the_kill_button_takes_the_jobs_own_secret(make_server):
    server = make_server(job_secrets={"a": SA}, secret=SG, kill_button=True)
    join(server.address(), [("a", "r0")], secret=SA)
    refused = (403, "kill refused: that is not the job's secret")
    assert server.kill("r0", SG, "tester", "a") == refused
    assert server.kill("r0", SA, "tester", "b")[0] == 403  # b has the lighthouse's secret
    code, message = server.kill("r0", SA, "tester", "a")  # past the check: a/r0 is no server
    assert code == 502 and "kill of r0 at a/r0 failed" in message


def test_a_restart_with_a_state_file_brings_every_job_back(make_server, tmp_path):
    path = str(tmp_path / "lighthouse.json")
    first = make_server(state_file=path)
    marks = {}
    for job in ("default", "a", "b"):
        client = LighthouseClient(first.address(), timedelta(seconds=5), job_id=job)
        quorum = client.quorum("r0", T, step=7 if job == "b" else 3)
        marks[job] = quorum.quorum_id
        client.close()
    first.shutdown()
    assert (tmp_path / "lighthouse.json.jobs" / "a.json").exists()
    second = make_server(state_file=path)
    assert set(second.jobs.by_id) == {"default", "a", "b"}
    for job, mark in marks.items():
        membership = second.jobs.by_id[job].membership
        assert membership.high_water_step == (7 if job == "b" else 3)
        assert membership.quorum_id == mark
    # The fresh-start guard holds per job: b's group at step 0 is refused.
    client = LighthouseClient(second.address(), timedelta(seconds=5), job_id="b")
    started = time.monotonic()
    with pytest.raises(QuorumTimeoutError, match="committed step 7"):
        client.quorum("r9", timedelta(seconds=1))
    assert time.monotonic() - started < 10
    client.close()
