"""The floor under bench.lighthouse_scale: the lean gRPC server (the
lighthouse's own, lighthouse.rpc.lean.server) serving LighthouseService with
handlers that do nothing. Quorum answers a fixed view at once, heartbeats
are read and dropped. Its CPU per call and its latency at a step's burst
are what the HTTP/2 server and asyncio cost before any lighthouse logic.

    python -m bench._null_lighthouse --bind 127.0.0.1:PORT --groups N
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from lighthouse.rpc import serve
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc


class NullServicer(pb_grpc.LighthouseServiceServicer):
    """Answers at once, a view of a quorum of `groups`; the methods the
    load does not call stay UNIMPLEMENTED."""

    def __init__(self, groups: int) -> None:
        view = pb.ManagerQuorumResponse(quorum_id=1, replica_world_size=groups, store_address="s:1")
        self.answer = pb.LighthouseQuorumResponse(views=[view]).SerializeToString()

    async def Quorum(self, request: Any, context: Any) -> bytes:
        return self.answer

    async def Heartbeat(self, request: Any, context: Any) -> pb.LighthouseHeartbeatResponse:
        return pb.LighthouseHeartbeatResponse()

    async def HeartbeatPaced(self, requests: Any, context: Any) -> None:
        async for _ in requests:
            pass


async def main(bind: str, groups: int) -> None:
    server = serve.new_server(
        pb_grpc.add_LighthouseServiceServicer_to_server, NullServicer(groups), None, "null", "lean"
    )
    host, _, port = bind.rpartition(":")
    serve.bind(server, host, int(port), "choose another port", None)
    await server.start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--bind", required=True)
    parser.add_argument("--groups", type=int, required=True, help="the quorum size it answers")
    args = parser.parse_args()
    asyncio.run(main(args.bind, args.groups))
