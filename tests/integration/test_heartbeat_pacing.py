"""HeartbeatPaced against a real lighthouse: the advice grows with the job
and stays under a third of the heartbeat timeout, a ManagerServer follows
it, and a lighthouse without HeartbeatPaced gets the plain stream."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from grpc import aio

from lighthouse import LighthouseClient, LighthouseServer
from lighthouse.client import AsyncLighthouseClient
from lighthouse.core.pacing import advised_interval_ms
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from tests.waiting import wait_until, wait_until_async
from torchft_like.manager.group.server import ManagerServer

pytestmark = pytest.mark.timeout(60)
TIMEOUT = timedelta(seconds=5)


def others_heartbeat(address: str, count: int) -> None:
    """`count` more replicas known to the lighthouse (one unary heartbeat each)."""
    client = LighthouseClient(address)
    try:
        for i in range(count):
            client.heartbeat(f"other{i}:x")
    finally:
        client.close()


async def advice_after(client: AsyncLighthouseClient, rid: str, wanted_ms: int) -> int:
    """Heartbeats until the advice is `wanted_ms` (at most 5 s); the last advice."""
    got = 0

    async def advised() -> bool:
        nonlocal got
        assert await client.stream_heartbeat(rid, TIMEOUT)
        advice = client.advised_interval()
        got = int(advice.total_seconds() * 1000) if advice else 0
        return got == wanted_ms

    await wait_until_async(advised, 5, lambda: f"an advice of {wanted_ms} ms (the last: {got} ms)")
    return got


@pytest.mark.parametrize("timeout_ms", [5000, 450])
def test_the_advice_grows_with_the_job_and_stays_under_a_third_of_the_timeout(timeout_ms):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=timeout_ms)

    async def scenario() -> None:
        client = AsyncLighthouseClient(server.address())
        try:
            small = advised_interval_ms(1, timeout_ms)
            assert await advice_after(client, "paced:1", small) == small
            # 150 more replicas: 151 at 1000 heartbeats/s would be 151 ms, so 200
            # ms; with a 450 ms timeout, the cap of 150 ms wins.
            await asyncio.to_thread(others_heartbeat, server.address(), 150)
            grown = advised_interval_ms(151, timeout_ms)
            assert grown == min(200, timeout_ms // 3)
            assert await advice_after(client, "paced:1", grown) == grown
            assert server.metrics.heartbeat_advice.labels("default")._value.get() == grown / 1000
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        server.shutdown()


def test_a_manager_server_heartbeats_at_the_advised_period():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=5000)
    others_heartbeat(server.address(), 150)  # advice: 200 ms
    counted = server.metrics.heartbeats.labels("default")._value.get
    others = counted()
    manager = ManagerServer(
        replica_id="follower:1",
        lighthouse_addr=server.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="follower-store:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=50),
    )
    try:
        # The first brought the advice, read by the second.
        wait_until(lambda: counted() >= others + 2, 10, "the manager server's first 2 heartbeats")
        before = counted()
        time.sleep(1.0)  # the window the rate is measured over
        sent = counted() - before
        # 20 a second at its own 50 ms; the lighthouse asked for 200 ms.
        assert 3 <= sent <= 8, f"{sent} heartbeats in 1 s"
    finally:
        manager.shutdown()
        server.shutdown()


class _OlderLighthouse(pb_grpc.LighthouseServiceServicer):
    """A lighthouse of before HeartbeatPaced: the generated base answers it
    UNIMPLEMENTED; HeartbeatStream counts what it receives."""

    def __init__(self) -> None:
        self.stream_heartbeats: list[str] = []

    async def HeartbeatStream(self, request_iterator, context):
        async for request in request_iterator:
            self.stream_heartbeats.append(request.replica_id)
        return pb.LighthouseHeartbeatResponse()


def test_a_lighthouse_without_heartbeat_paced_gets_the_plain_stream():
    async def scenario() -> None:
        older = _OlderLighthouse()
        server = aio.server()
        pb_grpc.add_LighthouseServiceServicer_to_server(older, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = AsyncLighthouseClient(f"http://127.0.0.1:{port}")

        async def reached() -> bool:
            if older.stream_heartbeats:
                return True
            assert await client.stream_heartbeat("old:1", TIMEOUT)
            return False

        try:
            await wait_until_async(reached, 15, "a heartbeat to reach HeartbeatStream")
            assert older.stream_heartbeats[0] == "old:1"
            assert client.advised_interval() is None
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(scenario())
