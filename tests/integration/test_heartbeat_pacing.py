"""HeartbeatPaced against a real lighthouse: the advice grows with the job
and stays under a third of the heartbeat timeout, a ManagerServer follows
it, and a lighthouse without HeartbeatPaced gets the plain stream."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import grpc
import pytest

from lighthouse import LighthouseClient, LighthouseServer
from lighthouse.client import AsyncLighthouseClient
from lighthouse.pacing import advised_interval_ms
from lighthouse.server import _LighthouseServicer
from torchft_like.manager_server import ManagerServer

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
    deadline = time.monotonic() + 5
    while True:
        assert await client.stream_heartbeat(rid, TIMEOUT)
        advice = client.advised_interval()
        got = int(advice.total_seconds() * 1000) if advice else 0
        if got == wanted_ms or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


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
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        server.shutdown()


def test_a_manager_server_heartbeats_at_the_advised_period():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=5000)
    others_heartbeat(server.address(), 150)  # advice: 200 ms
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
        time.sleep(0.5)  # the first heartbeat brought the advice
        before = server.metrics.heartbeats._value.get()
        time.sleep(1.0)
        sent = server.metrics.heartbeats._value.get() - before
        # 20 a second at its own 50 ms; the lighthouse asked for 200 ms.
        assert 3 <= sent <= 8, f"{sent} heartbeats in 1 s"
    finally:
        manager.shutdown()
        server.shutdown()


def test_a_lighthouse_without_heartbeat_paced_gets_the_plain_stream(monkeypatch):
    async def unimplemented(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(_LighthouseServicer, "HeartbeatPaced", unimplemented)
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)

    async def scenario() -> None:
        client = AsyncLighthouseClient(server.address())
        try:
            deadline = time.monotonic() + 15
            while server._coord.open_streams.get("old:1") != 1:
                streams = server._coord.open_streams
                assert time.monotonic() < deadline, f"no HeartbeatStream opened: {streams}"
                assert await client.stream_heartbeat("old:1", TIMEOUT)
                await asyncio.sleep(0.05)
            assert client.advised_interval() is None
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        server.shutdown()
