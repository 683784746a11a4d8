"""What a HeartbeatPaced stream that breaks the rules is told, on both RPC
servers (lean_server takes each heartbeat within its read, grpcio's through
the handler's iterator): a heartbeat without a replica_id, a second
replica_id on one stream, and a twin of a live group end the stream with
the reason, and the lighthouse goes on serving the others. A real
lighthouse and real gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from lighthouse import LighthouseServer
from lighthouse.client import HEARTBEAT_PACED_METHOD
from lighthouse.rpc.lean.client import LeanChannel
from lighthouse.rpc.lean.client_calls import CallFailed
from lighthouse.rpc.proto import torchft_pb2 as pb

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["lean", "grpcio"])
def server(request):
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=5000, rpc_server=request.param
    )
    yield server
    server.shutdown()


def beat(rid: str) -> bytes:
    return pb.LighthouseHeartbeatRequest(replica_id=rid).SerializeToString()


async def ended(
    target: str, *rids: str, burst: bool = False
) -> tuple[CallFailed | None, list[int]]:
    """Sends heartbeats of `rids` on one stream (`burst`: without waiting
    for each to be advised): how it ended, and the advice it got."""
    channel = LeanChannel(target)
    advice: list[int] = []
    try:
        stream = await channel.stream(
            HEARTBEAT_PACED_METHOD,
            lambda m: advice.append(pb.LighthouseHeartbeatAdvice.FromString(m).interval_ms),
        )
        for i, rid in enumerate(rids):
            stream.write(beat(rid))
            for _ in range(100 if i < len(rids) - 1 and not burst else 0):  # advised
                if advice:
                    break
                await asyncio.sleep(0.05)
        try:
            await asyncio.wait_for(asyncio.shield(stream.ended), 10)
        except CallFailed as e:
            return e, advice
        return None, advice
    finally:
        channel.close()


def alive(server: LighthouseServer) -> set[str]:
    return {r["replica_id"] for r in server.status()["replicas"] if r["healthy"]}


@pytest.mark.parametrize(
    "rids, burst, code, text",
    [
        (("",), False, grpc.StatusCode.INVALID_ARGUMENT, "replica_id must be a non-empty string"),
        (("a:1", "b:1"), False, grpc.StatusCode.INVALID_ARGUMENT, "one heartbeat stream carries"),
        # The second id while the first one's advice is being written: grpcio
        # failed the abort and never ended the stream.
        (("a:1", "b:1"), True, grpc.StatusCode.INVALID_ARGUMENT, "one heartbeat stream carries"),
    ],
)
def test_a_stream_that_breaks_the_rules_is_ended_with_the_reason(server, rids, burst, code, text):
    target = server.address().removeprefix("http://")
    error, advice = asyncio.run(ended(target, *rids, burst=burst))
    assert error is not None and error.code == code, error
    assert text in error.details
    assert len(advice) == (0 if rids == ("",) else 1)  # advised after its one good heartbeat


def test_a_twin_of_a_live_group_is_refused_on_its_stream_and_the_live_one_stays(server):
    target = server.address().removeprefix("http://")

    async def both() -> CallFailed | None:
        channel = LeanChannel(target)
        try:
            live = await channel.stream(HEARTBEAT_PACED_METHOD, lambda m: None)
            live.write(beat("group:1"))
            for _ in range(100):  # until the lighthouse knows group:1 live
                if alive(server) == {"group:1"}:
                    break
                await asyncio.sleep(0.05)
            error, _ = await ended(target, "group:2")
            live.write(beat("group:1"))  # still served, while its stream is open
            for _ in range(50):
                if alive(server) == {"group:1"}:
                    break
                await asyncio.sleep(0.1)
            assert alive(server) == {"group:1"} and not live.ended.done()
            return error
        finally:
            channel.close()

    error = asyncio.run(both())
    assert error is not None and error.code == grpc.StatusCode.ALREADY_EXISTS, error
    assert "group:1" in error.details
