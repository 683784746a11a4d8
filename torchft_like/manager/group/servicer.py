"""The gRPC face of a group's ManagerServer: ManagerService's four calls,
each turned into the server's own call and its errors into statuses
(lighthouse.rpc.errors). Peers and other ranks call it; rank 0 calls the
server in process (client.LocalManagerClient)."""

from __future__ import annotations

from typing import Protocol

from lighthouse.core.views import QuorumResult
from lighthouse.loop import reply_budget_s
from lighthouse.rpc import errors
from lighthouse.rpc.call import Call
from lighthouse.rpc.proto import torchft_pb2 as pb
from torchft_like.manager.group import wire
from torchft_like.manager.group.group_request import QuorumRequest


class GroupCalls(Protocol):
    """What the servicer asks of the ManagerServer."""

    async def quorum(self, request: QuorumRequest, timeout_s: float | None) -> QuorumResult: ...
    async def should_commit(
        self, group_rank: int, step: int, vote: bool, timeout_s: float | None = None
    ) -> bool: ...
    def checkpoint_metadata(self, rank: int) -> str: ...
    def remote_kill(self, msg: str, peer: str) -> None: ...


class ManagerServicer:
    """ManagerService, registered by its method names. Thin: converts, calls
    the server, converts back, maps errors (lighthouse.rpc.errors)."""

    def __init__(self, server: GroupCalls) -> None:
        self._s = server

    async def Quorum(
        self, request: pb.ManagerQuorumRequest, call: Call
    ) -> pb.ManagerQuorumResponse:
        try:
            req = wire.quorum_request_from_proto(request)
            result = await self._s.quorum(req, reply_budget_s(call.time_remaining()))
        except Exception as e:
            await errors.abort(call, e)
        return wire.result_to_proto(result)

    async def ShouldCommit(
        self, request: pb.ShouldCommitRequest, call: Call
    ) -> pb.ShouldCommitResponse:
        try:
            group_rank, step, vote = wire.should_commit_request_from_proto(request)
            budget_s = reply_budget_s(call.time_remaining())
            decision = await self._s.should_commit(group_rank, step, vote, budget_s)
        except Exception as e:
            await errors.abort(call, e)
        return pb.ShouldCommitResponse(should_commit=decision)

    async def CheckpointMetadata(
        self, request: pb.CheckpointMetadataRequest, call: Call
    ) -> pb.CheckpointMetadataResponse:
        try:
            metadata = self._s.checkpoint_metadata(request.rank)
        except Exception as e:
            await errors.abort(call, e)
        return pb.CheckpointMetadataResponse(checkpoint_metadata=metadata)

    async def Kill(self, request: pb.KillRequest, call: Call) -> pb.KillResponse:
        try:
            self._s.remote_kill(request.msg, call.peer())
        except Exception as e:
            await errors.abort(call, e)
        return pb.KillResponse()
