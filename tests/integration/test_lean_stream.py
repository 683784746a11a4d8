"""Streaming calls on the lean client (lighthouse.rpc.lean.client.LeanStream)
against both real servers, lean and grpcio, and the lighthouse client's
heartbeat stream on it: messages both ways past the first window, statuses
as grpcio reports them, cancellation, and grpcio's stream wherever the
lean one cannot go."""

from __future__ import annotations

import asyncio
import socket
from datetime import timedelta

import grpc
import pytest

from lighthouse import LighthouseServer
from lighthouse.client import HEARTBEAT_PACED_METHOD, AsyncLighthouseClient
from lighthouse.rpc import auth
from lighthouse.rpc.errors import QuorumError
from lighthouse.rpc.lean.client import CallFailed, LeanChannel, Unavailable
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from tests.integration.test_lean_server import SECRET, serving
from tests.waiting import wait_until_async


@pytest.fixture(params=["lean", "grpcio"])
def server(request):
    with serving(request.param) as (servicer, port):
        yield servicer, f"127.0.0.1:{port}"


def heartbeat(rid: str) -> bytes:
    return pb.LighthouseHeartbeatRequest(replica_id=rid).SerializeToString()


async def advices_for(target: str, ids: list[str], pause_every: int = 0):
    """(advised intervals, the stream, its channel) for one heartbeat per id;
    with `pause_every`, a wait for the answers so far after that many."""
    channel = LeanChannel(target, auth.metadata(SECRET))
    got: list[int] = []

    def on_message(message: bytes) -> None:
        got.append(pb.LighthouseHeartbeatAdvice.FromString(message).interval_ms)

    async def answered(n: int) -> None:
        await wait_until_async(
            lambda: len(got) >= n or stream.ended.done(), 10, f"{n} advices or the stream's end"
        )

    stream = await channel.stream(HEARTBEAT_PACED_METHOD, on_message)
    for i, rid in enumerate(ids, 1):
        stream.write(heartbeat(rid))
        if pause_every and i % pause_every == 0:
            await answered(i)
    await answered(len(ids))
    return got, stream, channel


def test_messages_go_both_ways_and_a_cancel_ends_the_handler(server):
    servicer, target = server

    async def run():
        got, stream, channel = await advices_for(target, ["a", "bb", "ccc"])
        assert got == [1, 2, 3] and not stream.ended.done()
        stream.cancel()
        assert "cancelled" in str(stream.ended.exception())
        with pytest.raises(Unavailable, match="ended"):
            stream.write(heartbeat("a"))
        channel.close()

    asyncio.run(run())
    assert servicer.ended_event.wait(5) and servicer.ended == ["paced"]


def test_messages_past_the_servers_first_window_flow_on_its_updates(server):
    """2,500 heartbeats of ~60 bytes: over 64 KB, the smallest first window."""
    _, target = server
    ids = ["x" * 55] * 2500

    async def run():
        got, stream, channel = await advices_for(target, ids, pause_every=250)
        assert got == [55] * 2500
        stream.cancel()
        channel.close()

    asyncio.run(run())


def test_a_status_ends_the_stream_as_grpcio_reports_it(server):
    _, target = server

    async def run():
        _, stream, channel = await advices_for(target, ["a", "raise"])
        with pytest.raises(CallFailed) as e:
            await asyncio.wait_for(stream.ended, 5)
        refusal = (grpc.StatusCode.INVALID_ARGUMENT, "one replica_id per stream")
        assert (e.value.code, e.value.details) == refusal
        with pytest.raises(Unavailable, match="ended"):
            stream.write(heartbeat("a"))
        channel.close()

    asyncio.run(run())


def test_the_lighthouse_clients_heartbeats_go_lean_and_its_end_is_a_death():
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=60_000)

    def healthy() -> bool:
        (replica,) = lighthouse.status()["replicas"]
        return bool(replica["healthy"])

    async def run():
        client = AsyncLighthouseClient(lighthouse.address())
        try:
            for _ in range(3):
                assert await client.stream_heartbeat("g:1", timedelta(seconds=5))
            assert client._calls.lean is not None and client._calls.lean.connected
            assert client.heartbeat_stream_open()
            await wait_until_async(
                lambda: lighthouse.status()["replicas"] and healthy(), 5, "the heartbeats to count"
            )
            client.close_heartbeat_stream()
            assert not client.heartbeat_stream_open()
            await wait_until_async(
                lambda: not healthy(), 5, "the lighthouse to take the stream's end as a death"
            )
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        lighthouse.shutdown()


class _Unpaced(pb_grpc.LighthouseServiceServicer):
    """A lighthouse with unary heartbeats only, as pytorch/torchft's: its
    streams answer what a server without them does."""

    async def Heartbeat(self, request, context):
        return pb.LighthouseHeartbeatResponse()

    async def HeartbeatStream(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    HeartbeatPaced = HeartbeatStream


@pytest.mark.parametrize("runtime", ["lean", "grpcio"])
def test_a_lighthouse_without_the_stream_gets_unary_heartbeats(runtime):
    with serving(runtime, _Unpaced()) as (_, port):

        async def run():
            client = AsyncLighthouseClient(f"http://127.0.0.1:{port}", secret=SECRET)
            try:
                # Writes may be taken before the refusal arrives; then a False,
                # after which the heartbeat loop sends unary heartbeats only.
                async def refused() -> bool:
                    try:
                        return await client.stream_heartbeat("g:1", timedelta(seconds=5)) is False
                    except QuorumError:  # grpcio may see the refusal as INTERNAL: again
                        return False

                await wait_until_async(refused, 10, "a False from stream_heartbeat")
                assert not client._paced
                await client.heartbeat("g:1", timedelta(seconds=5))
            finally:
                await client.close()

        asyncio.run(run())


def test_a_server_that_reads_nothing_stops_the_stream_within_its_window():
    """No SETTINGS, no WINDOW_UPDATE: 65,535 bytes, then `Unavailable` (the
    heartbeats move to grpcio) rather than a buffer that grows for ever."""
    listener = socket.create_server(("127.0.0.1", 0))

    async def run():
        port = listener.getsockname()[1]
        channel = LeanChannel(f"127.0.0.1:{port}")
        stream = await channel.stream(HEARTBEAT_PACED_METHOD, lambda _: None)
        sent = 0
        with pytest.raises(Unavailable, match="window"):
            for sent in range(10_000):  # noqa: B007
                stream.write(heartbeat("x" * 55))
        assert 60 * sent <= 65_535 < 65 * (sent + 1)
        channel.close()

    try:
        asyncio.run(run())
    finally:
        listener.close()


def test_callers_that_find_no_connection_share_one_attempt(server):
    """A heartbeat and a Quorum call may both find none: two connections
    would leave one that closing the channel does not close."""
    _, target = server

    async def run():
        channel = LeanChannel(target, auth.metadata(SECRET))
        a, b = await asyncio.gather(
            channel.stream(HEARTBEAT_PACED_METHOD, lambda _: None),
            channel.stream(HEARTBEAT_PACED_METHOD, lambda _: None),
        )
        assert a._conn is b._conn
        a.cancel()
        b.cancel()
        channel.close()
        with pytest.raises(Unavailable, match="closed"):
            await channel.stream(HEARTBEAT_PACED_METHOD, lambda _: None)

    asyncio.run(run())
