"""Access control with a shared secret over real gRPC and HTTP, in one process."""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request
from datetime import timedelta

import grpc
import pytest
import torch
from grpc import aio
from torch.distributed import TCPStore

from lighthouse import LighthouseClient, LighthouseServer, QuorumError
from lighthouse.loop import BackgroundLoop
from lighthouse.rpc import auth
from lighthouse.rpc.address import url_to_target
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from tests.integration.test_manager import assert_identical, run_groups
from torchft_like import Manager, ProcessGroupGloo
from torchft_like.checkpointing import HTTPTransport
from torchft_like.manager.group.client import ManagerClient
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.server import ManagerServer

pytestmark = pytest.mark.timeout(90)
S = "s3cret-0123456789abcdef"
T = timedelta(seconds=10)
WRONG = [(None, "carried none"), ("wrong-secret", "carried a wrong one")]


def _lighthouse(min_replicas: int):
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=500,
        heartbeat_timeout_ms=1000,
        secret=S,
    )
    yield server
    server.shutdown()


@pytest.fixture
def lighthouse():
    yield from _lighthouse(1)


@pytest.fixture
def lighthouse_of_two():
    """For two groups' runs: see test_manager.lighthouse_of_two."""
    yield from _lighthouse(2)


def call_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    return () if secret is None else ((auth.METADATA_KEY, auth.header_value(secret)),)


def assert_refused(e: grpc.RpcError, service: str, carried: str) -> None:
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    assert f"this {service} requires the job's shared secret and the request {carried}" in (
        e.details()
    )
    assert "set TORCHFT_SECRET_FILE (a file holding the secret) or TORCHFT_SECRET" in e.details()


# ---- lighthouse ----------------------------------------------------------------


@pytest.mark.parametrize("secret, carried", WRONG)
def test_the_lighthouse_refuses_every_rpc_without_the_right_secret(lighthouse, secret, carried):
    channel = grpc.insecure_channel(url_to_target(lighthouse.address()))
    stub = pb_grpc.LighthouseServiceStub(channel)
    member = pb.QuorumMember(replica_id="intruder")
    calls = [
        (stub.Quorum, pb.LighthouseQuorumRequest(requester=member)),
        (stub.Heartbeat, pb.LighthouseHeartbeatRequest(replica_id="intruder")),
        (stub.Leave, pb.LighthouseLeaveRequest(replica_id="intruder")),
    ]
    try:
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as e:
                method(request, timeout=5, metadata=call_metadata(secret))
            assert_refused(e.value, "lighthouse", carried)
    finally:
        channel.close()
    # Nothing of the refused calls reached the coordinator.
    assert lighthouse.status()["replicas"] == []


def test_the_lighthouse_logs_a_refused_caller_once_at_warning_then_at_debug(lighthouse, caplog):
    caplog.set_level(logging.DEBUG, logger="lighthouse.rpc.auth")
    client = LighthouseClient(lighthouse.address())
    try:
        for _ in range(3):
            with pytest.raises(QuorumError):
                client.heartbeat("intruder")
    finally:
        client.close()
    records = [r for r in caplog.records if r.name == "lighthouse.rpc.auth"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert (
        records[0]
        .getMessage()
        .startswith(
            "refused /torchft.LighthouseService/Heartbeat from ipv4:127.0.0.1: unauthenticated: "
            "this lighthouse requires the job's shared secret and the request carried none"
        )
    )


@pytest.mark.parametrize("secret, carried", WRONG)
def test_the_lighthouse_client_reports_a_refusal_with_what_to_set(lighthouse, secret, carried):
    client = LighthouseClient(lighthouse.address(), secret=secret)
    try:
        with pytest.raises(QuorumError) as e:
            client.heartbeat("intruder")
    finally:
        client.close()
    assert carried in str(e.value) and "(UNAUTHENTICATED)" in str(e.value)
    assert f"Heartbeat at lighthouse {lighthouse.address()} failed" in str(e.value)


def test_the_lighthouse_serves_a_client_with_the_right_secret(lighthouse):
    client = LighthouseClient(lighthouse.address(), secret=S)
    try:
        client.heartbeat("member")
        quorum = client.quorum("member", timedelta(seconds=20), step=2)
    finally:
        client.close()
    assert quorum.replica_ids() == ("member",)


def test_a_lighthouse_without_a_secret_accepts_clients_that_send_one():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    client = LighthouseClient(server.address(), secret=S)
    try:
        assert client.quorum("a", timedelta(seconds=20)).replica_ids() == ("a",)
    finally:
        client.close()
        server.shutdown()


def test_the_status_page_stays_readable_and_has_no_action_with_or_without_the_secret():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_bind="127.0.0.1:0", secret=S)
    try:
        http = server.http_address()
        with urllib.request.urlopen(http + "/status.json", timeout=5) as r:
            assert r.status == 200 and "quorum_id" in r.read().decode()
        for secret in (None, S):
            for method in ("POST", "PUT", "DELETE"):
                request = urllib.request.Request(
                    http + "/", method=method, data=b"", headers=auth.http_headers(secret)
                )
                with pytest.raises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(request, timeout=5)
                assert e.value.code == 405 and e.value.headers["Allow"] == "GET"
                assert "the status page is read-only" in e.value.read().decode()
    finally:
        server.shutdown()


# ---- ManagerServer -----------------------------------------------------------


def make_manager_server(lighthouse: LighthouseServer, secret: str | None) -> ManagerServer:
    return ManagerServer(
        replica_id="group:1",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="store:1234",
        world_size=1,
        connect_timeout=T,
        secret=secret,
    )


@pytest.mark.parametrize("secret, carried", WRONG)
def test_the_manager_server_refuses_every_rpc_without_the_right_secret(lighthouse, secret, carried):
    server = make_manager_server(lighthouse, S)
    channel = grpc.insecure_channel(url_to_target(server.address()))
    stub = pb_grpc.ManagerServiceStub(channel)
    calls = [
        (stub.Quorum, pb.ManagerQuorumRequest(group_rank=0, step=0)),
        (stub.ShouldCommit, pb.ShouldCommitRequest(group_rank=0, step=0, should_commit=True)),
        (stub.CheckpointMetadata, pb.CheckpointMetadataRequest(rank=0)),
        # Kill is left out on purpose: if it were let through, it would end pytest.
    ]
    try:
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as e:
                method(request, timeout=5, metadata=call_metadata(secret))
            assert_refused(e.value, "manager server", carried)
    finally:
        channel.close()
        server.shutdown()


def test_the_manager_server_serves_a_client_with_the_right_secret(lighthouse):
    server = make_manager_server(lighthouse, S)
    client = ManagerClient(server.address(), T, secret=S)
    try:
        result = client.quorum(QuorumRequest(group_rank=0, step=3, checkpoint_metadata="meta"), T)
        assert result.replica_world_size == 1 and result.max_step == 3
        assert client.checkpoint_metadata(0, T) == "meta"
        assert client.should_commit(0, 3, True, T) is True
    finally:
        client.close()
        server.shutdown()


@pytest.mark.parametrize("secret, carried", WRONG)
def test_a_manager_server_without_the_lighthouse_secret_fails_at_start(lighthouse, secret, carried):
    with pytest.raises(QuorumError) as e:
        make_manager_server(lighthouse, secret)
    assert f"Heartbeat at lighthouse {lighthouse.address()} failed: unauthenticated" in str(e.value)
    assert carried in str(e.value)


# ---- streaming RPCs ----------------------------------------------------------


@pytest.fixture
def echo_server():
    """An aio server with the interceptor and two streaming methods, standing
    for streaming RPCs the services may add (they must be covered too)."""

    async def unary_stream(request, context):
        for _ in range(2):
            yield request

    async def stream_stream(requests, context):
        async for request in requests:
            yield request

    async def stream_unary(requests, context):
        return b"".join([r async for r in requests])

    loop = BackgroundLoop("echo")

    async def start():
        server = aio.server(interceptors=auth.server_interceptors(S, "echo server"))
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "test.Echo",
                    {
                        "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
                        "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream),
                        "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
                    },
                )
            ]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run(start())
    yield f"127.0.0.1:{port}"
    loop.run(server.stop(None))
    loop.stop()


@pytest.mark.parametrize("secret, carried", WRONG)
def test_streaming_rpcs_are_refused_without_the_right_secret(echo_server, secret, carried):
    channel = auth.intercept_channel(grpc.insecure_channel(echo_server), secret)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(channel.unary_stream("/test.Echo/UnaryStream")(b"x", timeout=5))
        assert_refused(e.value, "echo server", carried)
        with pytest.raises(grpc.RpcError) as e:
            list(channel.stream_stream("/test.Echo/StreamStream")(iter([b"x"]), timeout=5))
        assert_refused(e.value, "echo server", carried)
        with pytest.raises(grpc.RpcError) as e:
            channel.stream_unary("/test.Echo/StreamUnary")(iter([b"x"]), timeout=5)
        assert_refused(e.value, "echo server", carried)
    finally:
        channel.close()


def test_streaming_rpcs_pass_with_the_secret_on_blocking_and_asyncio_channels(echo_server):
    channel = auth.intercept_channel(grpc.insecure_channel(echo_server), S)
    try:
        assert list(channel.unary_stream("/test.Echo/UnaryStream")(b"x", timeout=5)) == [b"x"] * 2
        out = channel.stream_stream("/test.Echo/StreamStream")(iter([b"a", b"b"]), timeout=5)
        assert list(out) == [b"a", b"b"]
        assert channel.stream_unary("/test.Echo/StreamUnary")(iter([b"a", b"b"]), timeout=5) == (
            b"ab"
        )
    finally:
        channel.close()

    async def over_aio() -> tuple[list[bytes], list[bytes]]:
        async with aio.insecure_channel(
            echo_server, interceptors=auth.aio_client_interceptors(S)
        ) as ch:
            unary_stream = ch.unary_stream("/test.Echo/UnaryStream")
            stream_stream = ch.stream_stream("/test.Echo/StreamStream")
            first = [r async for r in unary_stream(b"y", timeout=5)]
            second = [r async for r in stream_stream(iter([b"z"]), timeout=5)]
            return first, second

    assert asyncio.run(over_aio()) == ([b"y", b"y"], [b"z"])


def test_an_asyncio_stream_written_call_by_call_carries_the_secret(echo_server):
    """The pattern of a streaming heartbeat: write, read, write, read, close."""

    async def chat() -> list[bytes]:
        async with aio.insecure_channel(
            echo_server, interceptors=auth.aio_client_interceptors(S)
        ) as ch:
            call = ch.stream_stream("/test.Echo/StreamStream")(timeout=5)
            got = []
            for beat in (b"1", b"2"):
                await call.write(beat)
                got.append(await call.read())
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            return got

    assert asyncio.run(chat()) == [b"1", b"2"]


# ---- checkpoint transfers ----------------------------------------------------


@pytest.fixture
def make_transport():
    made: list[HTTPTransport] = []

    def make(secret: str | None, **kwargs) -> HTTPTransport:
        made.append(HTTPTransport(timeout=T, hostname="127.0.0.1", secret=secret, **kwargs))
        return made[-1]

    yield make
    for transport in made:
        transport.shutdown()


@pytest.mark.parametrize("secret, carried", WRONG)
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_a_checkpoint_fetch_without_the_right_secret_gets_401_and_says_so(
    make_transport, secret, carried, num_chunks
):
    source, receiver = make_transport(S), make_transport(secret, num_chunks=num_chunks)
    source.send_checkpoint([1], 5, {"w": torch.arange(10.0)}, T)
    # A refusal is final: the receiver must not retry it until the 20 s timeout.
    with pytest.raises(RuntimeError) as e:
        receiver.recv_checkpoint(0, source.metadata(), 5, timedelta(seconds=20))
    text = str(e.value)
    assert f"could not fetch step 5 from replica rank 0 at {source.metadata()}" in text
    assert "answered HTTP 401: unauthenticated: this checkpoint server requires" in text
    assert carried in text and "TORCHFT_SECRET_FILE" in text


def test_a_plain_http_request_without_the_secret_gets_401_with_www_authenticate(
    make_transport, caplog
):
    source = make_transport(S)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(source.metadata() + "0", timeout=5)
    assert e.value.code == 401
    assert e.value.headers["WWW-Authenticate"] == 'Bearer realm="torchft"'
    assert "carried none" in e.value.read().decode()
    assert any(
        r.levelno == logging.WARNING
        and r.getMessage().startswith("refused a checkpoint GET from 127.0.0.1: unauthenticated")
        for r in caplog.records
    )


@pytest.mark.parametrize("num_chunks", [1, 4])
def test_a_checkpoint_fetch_with_the_secret_gets_the_state(make_transport, num_chunks):
    source, receiver = make_transport(S), make_transport(S, num_chunks=num_chunks)
    state = {"w": torch.arange(1000.0), "step": 5}
    source.send_checkpoint([1], 5, state, T)
    got = receiver.recv_checkpoint(0, source.metadata(), 5, T)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 5


# ---- Manager -----------------------------------------------------------------


def test_a_run_with_the_secret_in_the_environment_trains_heals_and_commits(
    lighthouse_of_two, monkeypatch
):
    """Two groups of two ranks: the Managers read TORCHFT_SECRET; rank 1 talks
    to rank 0's ManagerServer over gRPC, and init_sync heals group 1 from
    group 0 over HTTP (the groups start from different weights)."""
    monkeypatch.setenv(auth.SECRET_ENV, S)
    results = run_groups(lighthouse_of_two, 2, steps=3, group_world_size=2)
    for rank in range(2):
        assert results[0][rank]["step"] == 3
        assert all(committed for _, committed in results[0][rank]["commits"])
        assert_identical(results[0][rank], results[1][rank])


def make_manager(lighthouse: LighthouseServer, store: TCPStore, **kwargs) -> Manager:
    return Manager(
        pg=ProcessGroupGloo(timeout=T),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        connect_timeout=T,
        **kwargs,
    )


def test_a_manager_without_the_secret_fails_at_start_saying_what_to_set(lighthouse, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(QuorumError) as e:
        make_manager(lighthouse, store)
    assert "this lighthouse requires the job's shared secret" in str(e.value)
    assert "TORCHFT_SECRET_FILE" in str(e.value)


def test_a_manager_refuses_a_checkpoint_transport_with_another_secret(lighthouse):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    transport = HTTPTransport(timeout=T, hostname="127.0.0.1")
    try:
        with pytest.raises(ValueError, match="checkpoint_transport's secret differs"):
            make_manager(lighthouse, store, secret=S, checkpoint_transport=transport)
    finally:
        transport.shutdown()


@pytest.mark.parametrize(
    "make, source",
    [
        (
            lambda: LighthouseServer(bind="127.0.0.1:0", min_replicas=1, secret=""),
            "the lighthouse's `secret` argument",
        ),
        (lambda: HTTPTransport(timeout=T, secret=""), "HTTPTransport's `secret` argument"),
    ],
)
def test_an_empty_secret_argument_is_refused_not_taken_as_a_secret(make, source):
    with pytest.raises(ValueError, match=f"the secret in {source} is empty"):
        make()
