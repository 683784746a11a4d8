"""A Quorum call that waits, on both RPC servers (lean_server parks it with
no task and no future; grpcio's awaits a future): answered when its quorum
is issued, and withdrawn from the next quorum when it ends otherwise (the
caller cancels, its deadline comes, the replica leaves, the lighthouse
stops). A real lighthouse and real gRPC."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest

from lighthouse import LighthouseClient, LighthouseServer, QuorumTimeoutError
from lighthouse.client import QUORUM_METHOD
from lighthouse.rpc.lean.client import LeanChannel
from lighthouse.rpc.lean.client_calls import CallFailed
from lighthouse.rpc.proto import torchft_pb2 as pb
from tests.waiting import wait_until, wait_until_async
from tools import h2_peer as h2

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["lean", "grpcio"])
def server(request):
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,
        join_timeout_ms=300,
        heartbeat_timeout_ms=5000,
        rpc_server=request.param,
    )
    yield server
    server.shutdown()


def request(rid: str) -> bytes:
    member = pb.QuorumMember(replica_id=rid, address=f"http://{rid}:1", store_address=f"{rid}:2")
    return pb.LighthouseQuorumRequest(requester=member).SerializeToString()


def waiting(server: LighthouseServer) -> set[str]:
    return {r["replica_id"] for r in server.status()["replicas"] if r["waiting"]}


def quorum_of(server: LighthouseServer, rids: list[str]) -> tuple[str, ...]:
    results: dict[str, tuple[str, ...]] = {}

    def one(rid: str) -> None:
        client = LighthouseClient(server.address())
        try:
            results[rid] = client.quorum(rid, timedelta(seconds=20)).replica_ids()
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(results) == set(rids), f"answered: {sorted(results)}"
    assert len(set(results.values())) == 1
    return results[rids[0]]


def while_waiting(server: LighthouseServer, rid: str, then: Callable[[Any], Awaitable[None]]):
    """Runs `then(call)` once `rid`'s Quorum call (a task on a lean channel)
    waits at the lighthouse."""

    async def main() -> None:
        channel = LeanChannel(server.address().removeprefix("http://"))
        call = asyncio.ensure_future(channel.unary(QUORUM_METHOD, request(rid), 30))
        try:
            await wait_until_async(lambda: rid in waiting(server), what=f"{rid}'s call waiting")
            await then(call)
        finally:
            call.cancel()
            channel.close()

    asyncio.run(main())


def test_a_cancelled_call_is_withdrawn(server):
    async def cancel(call) -> None:
        call.cancel()  # RST_STREAM: the lighthouse sees the call end
        with pytest.raises(asyncio.CancelledError):
            await call

    while_waiting(server, "gone", cancel)
    wait_until(lambda: "gone" not in waiting(server), what="the cancelled call withdrawn")
    assert quorum_of(server, ["b", "c"]) == ("b", "c")


def test_a_call_past_its_deadline_says_what_was_missing_and_is_withdrawn(server):
    client = LighthouseClient(server.address())
    with pytest.raises(QuorumTimeoutError, match="no quorum containing late within"):
        client.quorum("late", timedelta(seconds=1))
    client.close()
    assert "late" not in waiting(server)
    assert quorum_of(server, ["b", "c"]) == ("b", "c")


def test_a_replica_that_leaves_while_waiting_is_told_so(server):
    async def leave(call) -> None:
        client = LighthouseClient(server.address())
        try:
            await asyncio.to_thread(client.leave, "a")
        finally:
            client.close()
        with pytest.raises(CallFailed, match="replica a left"):
            await call

    while_waiting(server, "a", leave)


def test_a_stopping_lighthouse_answers_its_waiting_calls(server):
    async def stop(call) -> None:
        await asyncio.to_thread(server.shutdown)
        with pytest.raises(CallFailed, match="shutting down"):
            await call

    while_waiting(server, "a", stop)


def test_a_request_ended_by_an_empty_data_frame_still_waits_for_its_quorum(server):
    """tonic (pytorch/torchft's Rust ManagerServer) sends the message, then
    END_STREAM on an empty DATA frame: the end of the request is not its
    absence, also while the call waits parked."""
    peer = h2.Peer(server.address(), h2.Budget(1 << 20, 20.0))
    try:
        sid = peer.open(h2.request_headers(peer.authority, h2.method("Quorum")))
        assert peer.send(h2.frame(h2.DATA, 0, sid, h2.grpc_message(request("a"))))
        assert peer.send(h2.frame(h2.DATA, h2.END_STREAM, sid, b""))
        wait_until(lambda: "a" in waiting(server), what="the call waiting")
        assert quorum_of(server, ["b"]) == ("a", "b")
        peer.wait_ended(sid)
        assert ("grpc-status", "0") in peer.answers[sid], peer.answers.get(sid)
    finally:
        peer.close()
