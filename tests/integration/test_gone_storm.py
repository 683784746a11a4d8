"""Many members gone at once (a job's end, a switch failure): the live ones
hear one notice naming them all, not one per death, which at N groups
would be O(N^2) messages. A real lighthouse and real HTTP/2 streams."""

from __future__ import annotations

import asyncio

import pytest

from lighthouse import LighthouseServer
from lighthouse.client import HEARTBEAT_PACED_METHOD, QUORUM_METHOD
from lighthouse.rpc.lean.client import LeanChannel
from lighthouse.rpc.proto import torchft_pb2 as pb
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(60)
DOOMED = 29


def test_members_gone_together_are_told_in_one_notice():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=DOOMED + 1)
    target = server.address().removeprefix("http://")
    notices: list[pb.LighthouseGoneNotice] = []

    def heard(message: bytes) -> None:
        advice = pb.LighthouseHeartbeatAdvice.FromString(message)
        if advice.HasField("gone"):
            notices.append(advice.gone)

    async def storm() -> None:
        survivor, doomed = LeanChannel(target), LeanChannel(target)
        rids = ["live"] + [f"d{i:02d}" for i in range(DOOMED)]
        for rid in rids:
            channel = survivor if rid == "live" else doomed
            on_message = heard if rid == "live" else (lambda _: None)
            stream = await channel.stream(HEARTBEAT_PACED_METHOD, on_message, 30)
            stream.write(pb.LighthouseHeartbeatRequest(replica_id=rid).SerializeToString())
        asks = []
        for rid in rids:
            member = pb.QuorumMember(replica_id=rid, address=f"http://{rid}:1")
            request = pb.LighthouseQuorumRequest(requester=member).SerializeToString()
            channel = survivor if rid == "live" else doomed
            asks.append(channel.unary(QUORUM_METHOD, request, 20))
        await asyncio.gather(*asks)  # one quorum of all 30
        doomed.close()  # the connection ends: 29 streams end in one read

        def all_told() -> bool:
            return any(len(n.replica_ids) == DOOMED for n in notices)

        await wait_until_async(all_told, what="a notice naming every gone member")
        await asyncio.sleep(0.3)  # any later notice would have come by now
        survivor.close()

    try:
        asyncio.run(storm())
    finally:
        server.shutdown()
    assert len(notices) == 1, [list(n.replica_ids) for n in notices]
