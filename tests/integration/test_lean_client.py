"""The lean unary client (lighthouse.rpc.lean.client) against both real
servers, lean and grpcio: the answers, statuses, deadlines and secret
refusals a grpcio client gets, and `Unavailable` wherever the caller must
fall back to grpcio."""

from __future__ import annotations

import asyncio
import socket
import time
from datetime import timedelta

import grpc
import pytest
from hpack import Decoder, Encoder

from lighthouse import LighthouseServer
from lighthouse.client import AsyncLighthouseClient
from lighthouse.core.quorum import QuorumMember
from lighthouse.rpc import auth
from lighthouse.rpc.h2.client_connection import ClientConnection
from lighthouse.rpc.h2.frames import literal
from lighthouse.rpc.lean import client as lean_client
from lighthouse.rpc.lean.client import CallFailed, LeanChannel, Unavailable
from lighthouse.rpc.proto import torchft_pb2 as pb
from tests.integration.test_lean_server import SECRET, serving
from tests.waiting import wait_until_async

HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
QUORUM = "/torchft.LighthouseService/Quorum"


@pytest.fixture(params=["lean", "grpcio"])
def server(request):
    """(servicer, target) of a server of each runtime, with a secret."""
    with serving(request.param) as (servicer, port):
        yield servicer, f"127.0.0.1:{port}"


def call(target: str, method: str, request: bytes, timeout_s: float = 5, secret=SECRET) -> bytes:
    async def once() -> bytes:
        channel = LeanChannel(target, auth.metadata(secret))
        try:
            return await channel.unary(method, request, timeout_s)
        finally:
            channel.close()

    return asyncio.run(once())


def heartbeat(rid: str) -> bytes:
    return pb.LighthouseHeartbeatRequest(replica_id=rid).SerializeToString()


def failed(*args, **kwargs) -> CallFailed:
    with pytest.raises(CallFailed) as e:
        call(*args, **kwargs)
    return e.value


def test_answers_and_statuses_are_those_a_grpcio_client_gets(server):
    _, target = server
    assert call(target, HEARTBEAT, heartbeat("ok")) == b""
    assert call(target, HEARTBEAT, heartbeat("wait")) == b""
    e = failed(target, HEARTBEAT, heartbeat("abort"))
    assert (e.code, e.details) == (grpc.StatusCode.INVALID_ARGUMENT, "bad: 100% wrong\nsecond line")
    e = failed(target, HEARTBEAT, heartbeat("boom"))
    assert e.code == grpc.StatusCode.UNKNOWN and "boom" in e.details
    assert failed(target, "/torchft.LighthouseService/Nope", b"").code == (
        grpc.StatusCode.UNIMPLEMENTED
    )


def test_without_the_secret_the_refusal_says_what_to_set(server):
    _, target = server
    for secret in (None, "wrong"):
        e = failed(target, HEARTBEAT, heartbeat("ok"), secret=secret)
        assert e.code == grpc.StatusCode.UNAUTHENTICATED and auth.SECRET_FILE_ENV in e.details


def test_an_answer_larger_than_the_window_arrives_whole(server):
    """3 MB, far past HTTP/2's default 64 KB window: it fits ours (RECV_WINDOW,
    given back once the answer is taken; tests/unit/test_lean_client_bounds.py)."""
    _, target = server
    request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(step=30_000))
    answer = pb.LighthouseQuorumResponse.FromString(
        call(target, QUORUM, request.SerializeToString(), timeout_s=30)
    )
    assert len(answer.quorum.participants) == 30_001
    assert answer.quorum.participants[-1].data == "30", "the deadline reached the server"


def test_a_passed_deadline_fails_the_call_and_cancels_the_handler(server):
    servicer, target = server
    start = time.monotonic()
    assert failed(target, HEARTBEAT, heartbeat("slow"), timeout_s=0.3).code == (
        grpc.StatusCode.DEADLINE_EXCEEDED
    )
    assert time.monotonic() - start < 3
    assert servicer.ended_event.wait(5) and servicer.ended == ["slow"]


def test_a_lost_connection_is_made_again_and_no_server_is_unavailable_for_a_while():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = f"127.0.0.1:{port}"
    member = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="a", step=0))

    async def run() -> None:
        channel = LeanChannel(target)
        for _ in range(2):  # the second lighthouse is reached on a new connection
            lighthouse = LighthouseServer(bind=target, min_replicas=1)
            try:
                answer = await channel.unary(QUORUM, member.SerializeToString(), 10)
                assert pb.LighthouseQuorumResponse.FromString(answer).quorum.participants
            finally:
                lighthouse.shutdown()
            await wait_until_async(
                lambda: not channel.connected, 5, "the connection's end to reach our loop"
            )
        with pytest.raises(Unavailable, match="cannot connect"):
            await channel.unary(QUORUM, member.SerializeToString(), 2)
        # Calls go through grpcio for a while rather than try again each time.
        with pytest.raises(Unavailable, match="moments ago"):
            await channel.unary(QUORUM, member.SerializeToString(), 2)
        channel.close()

    asyncio.run(run())


PROXY = "http://proxy:3128"


@pytest.mark.parametrize(
    "target, env, lean",
    [
        ("10.0.0.5:29510", {}, True),
        ("10.0.0.5:29510", {"https_proxy": PROXY}, False),
        ("10.0.0.5:29510", {"grpc_proxy": PROXY}, False),
        ("10.0.0.5:29510", {"http_proxy": PROXY, "no_proxy": "10.0.0.5"}, True),
        # CIDR blocks, for IPv4 and IPv6 targets; a name is not an address.
        ("10.0.0.5:29510", {"http_proxy": PROXY, "no_proxy": "localhost, 10.0.0.0/8"}, True),
        ("10.1.0.5:29510", {"http_proxy": PROXY, "no_proxy": "10.0.0.0/16"}, False),
        ("[fd00::7]:29510", {"http_proxy": PROXY, "no_proxy": "fd00::/64"}, True),
        ("lh.example:29510", {"http_proxy": PROXY, "no_proxy": "10.0.0.0/8"}, False),
        # Names end with an entry, case aside, as gRPC core matches them.
        ("LH.Cluster.Local:29510", {"http_proxy": PROXY, "no_proxy": ".cluster.local"}, True),
        ("lh.cluster.local:29510", {"http_proxy": PROXY, "no_proxy": "other.local,,"}, False),
        # no_grpc_proxy, when set, is read instead of no_proxy.
        ("lh:1", {"http_proxy": PROXY, "no_grpc_proxy": "x", "no_proxy": "lh"}, False),
        ("lh:1", {"http_proxy": PROXY, "no_grpc_proxy": "lh", "no_proxy": "x"}, True),
        # Upper-case names (which gRPC core does not read) and a proxy by
        # address: we stand aside rather than guess.
        ("lh:1", {"HTTPS_PROXY": PROXY, "no_proxy": "lh"}, False),
        ("lh:1", {"GRPC_ADDRESS_HTTP_PROXY": "10.0.0.1:3128"}, False),
        ("lh:1", {"http_proxy": PROXY, "NO_PROXY": "lh"}, False),
        ("lh:1", {"http_proxy": ""}, True),
    ],
)
def test_the_quorum_goes_lean_only_where_grpcio_would_connect_directly(target, env, lean):
    assert lean_client.usable(target, env) is lean


def test_with_a_proxy_set_the_quorum_goes_through_grpcio_unless_the_host_is_exempt(monkeypatch):
    async def lean() -> bool:
        client = AsyncLighthouseClient("http://127.0.0.1:1")
        await client.close()
        return client._calls.lean is not None

    for name in lean_client.PROXY_ENV + lean_client.NO_PROXY_ENV + lean_client.OTHER_PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
    assert asyncio.run(lean())
    monkeypatch.setenv("https_proxy", PROXY)
    assert not asyncio.run(lean())
    monkeypatch.setenv("no_proxy", "localhost,127.0.0.1")
    assert asyncio.run(lean())


def test_the_lighthouse_clients_quorum_goes_lean_and_keeps_grpcios_errors():
    """Every step's Quorum call takes the lean path (grpcio's stub is never
    called); a refusal raises what grpcio's path raises."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, secret=SECRET)

    async def run() -> None:
        member = QuorumMember(replica_id="a", address="a:1", store_address="s:1", step=0)
        ours = AsyncLighthouseClient(lighthouse.address(), secret=SECRET)

        def no_grpcio(*args, **kwargs):
            raise AssertionError("the Quorum call went through grpcio")

        ours._calls.grpcio.unary_unary = no_grpcio
        for _ in range(3):
            quorum = await ours.quorum(member, timedelta(seconds=10))
            assert [m.replica_id for m in quorum.participants] == ["a"]
        errors = []
        for lean in (True, False):
            wrong = AsyncLighthouseClient(lighthouse.address(), secret="wrong")
            if not lean:
                wrong._calls.lean = None
            with pytest.raises(Exception) as e:
                await wrong.quorum(member, timedelta(seconds=5))
            errors.append((type(e.value), str(e.value)))
            await wrong.close()
        assert errors[0] == errors[1] and "UNAUTHENTICATED" in errors[0][1], errors
        await ours.close()

    try:
        asyncio.run(run())
    finally:
        lighthouse.shutdown()


def test_header_blocks_decode_as_a_fresh_decoder_would_and_only_literal_ones_are_reused():
    """Our server's answers (literals, the table empty) are decoded once;
    blocks that use or change the table (a tonic server's) every time."""
    conn, reference = ClientConnection(), Decoder()
    ours = literal(":status", "200") + literal("content-type", "application/grpc")
    first = conn._decode(ours)
    assert first == [(":status", "200"), ("content-type", "application/grpc")]
    assert conn._decode(ours) is first  # reused
    resize = b"\x3f\xe1\x1f" + ours  # a table size update (4096) first: never reused
    assert conn._decode(resize) == first and conn._decode(resize) is not first
    encoder = Encoder()  # indexes what it sends: the table fills and is then referenced
    trailers = [("grpc-status", "0"), ("grpc-message", "")]
    for block in [ours, resize] + [encoder.encode(trailers) for _ in range(3)] + [ours]:
        assert conn._decode(block) == [(str(k), str(v)) for k, v in reference.decode(block)]
    assert conn._decoded == {ours: first}


def test_against_a_server_that_sends_goaway_and_never_closes_we_hold_at_most_two_sockets():
    """A raw server: it answers every call, then sends GOAWAY and never
    closes. Each call then goes on a new connection; the old ones are
    closed by us (issue 48), not held one per step."""
    import struct

    from lighthouse.rpc.h2.frames import DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, frame

    answer = literal(":status", "200") + literal("content-type", "application/grpc")
    trailers = literal("grpc-status", "0")
    open_sockets: set[asyncio.StreamWriter] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_sockets.add(writer)
        try:
            await reader.readexactly(24)  # the preface
            writer.write(frame(4, 0, 0, b""))  # our SETTINGS
            while True:
                head = await reader.readexactly(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags, sid = head[3], head[4], struct.unpack(">I", head[5:])[0] & 0x7FFFFFFF
                await reader.readexactly(length)
                if kind == DATA and flags & END_STREAM:
                    writer.write(
                        frame(HEADERS, END_HEADERS, sid, answer)
                        + frame(DATA, 0, sid, b"\0\0\0\0\2ok")
                        + frame(HEADERS, END_HEADERS | END_STREAM, sid, trailers)
                        + frame(GOAWAY, 0, 0, struct.pack(">II", sid, 0))
                    )
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed it: never we
        finally:
            open_sockets.discard(writer)

    async def scenario() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        channel = LeanChannel(f"127.0.0.1:{port}")
        try:
            for _ in range(20):
                assert await channel.unary(QUORUM, b"", 5) == b"ok"
                assert len(open_sockets) <= 2
            await wait_until_async(lambda: len(open_sockets) <= 1, timeout=5)
        finally:
            channel.close()
            server.close()

    asyncio.run(scenario())
