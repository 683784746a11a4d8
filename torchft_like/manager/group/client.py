"""What a rank asks of its group's ManagerServer, and the gRPC client that asks it.

Group rank 0 hosts the server and calls it in process
(`LocalManagerClient`); the other ranks, and a healing peer
asking for checkpoint metadata, go over gRPC (`ManagerClient`). Both honour
`ManagerClientProtocol` with public methods only.
"""

from __future__ import annotations

from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Protocol

from lighthouse.core.views import QuorumResult
from lighthouse.loop import LoopStalledError
from lighthouse.rpc.address import url_to_target
from lighthouse.rpc.channel import BlockingCalls
from lighthouse.rpc.errors import QuorumTimeoutError
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig, check_scheme
from torchft_like.manager.group import wire
from torchft_like.manager.group.group_request import QuorumRequest


class ManagerClientProtocol(Protocol):
    """A rank's calls to its group's ManagerServer.

    Errors come from lighthouse.rpc.errors: QuorumTimeoutError names who was
    missing and why, LighthouseUnavailableError an unreachable server,
    NotServedError missing checkpoint metadata, ValueError bad input.
    """

    def quorum(self, request: QuorumRequest, timeout: timedelta) -> QuorumResult:
        """Waits until every rank of the group asked and the lighthouse answered."""
        ...

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """True only if every rank of the group voted True for `step`."""
        ...

    def checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """What group rank `rank` told the server about fetching its state."""
        ...

    def kill(self, msg: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Ends the server's process (the group), logging `msg`."""
        ...

    def close(self) -> None: ...


class ManagerClient:
    """Blocking gRPC client of a ManagerServer (see ManagerClientProtocol).

    Args:
        addr: the server's URL, `http://host:port`.
        connect_timeout: bound on the first connection (and on reconnecting
            after the server was unreachable).
        secret: the job's shared secret, sent with every call (lighthouse.rpc.auth).
        tls: connect over TLS (lighthouse.rpc.tls); `addr` is then https://.
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta = timedelta(seconds=10),
        secret: str | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.addr = addr
        check_scheme(addr, tls, "manager server address")
        target = url_to_target(addr, "manager server address")
        peer = f"manager server {addr}"
        self._calls = BlockingCalls(target, peer, connect_timeout, secret, tls)
        self._stub = pb_grpc.ManagerServiceStub(self._calls.channel)

    def _call(self, method: Any, request: Any, timeout: timedelta, what: str) -> Any:
        return self._calls.call(method, request, timeout.total_seconds(), what)

    def quorum(self, request: QuorumRequest, timeout: timedelta) -> QuorumResult:
        message = wire.quorum_request_to_proto(request)
        return wire.result_from_proto(self._call(self._stub.Quorum, message, timeout, "Quorum"))

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        message = wire.should_commit_request_to_proto(group_rank, step, should_commit)
        response = self._call(self._stub.ShouldCommit, message, timeout, "ShouldCommit")
        return bool(response.should_commit)

    def checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        message = pb.CheckpointMetadataRequest(rank=rank)
        response = self._call(self._stub.CheckpointMetadata, message, timeout, "CheckpointMetadata")
        return str(response.checkpoint_metadata)

    def kill(self, msg: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        self._call(self._stub.Kill, pb.KillRequest(msg=msg), timeout, "Kill")

    def close(self) -> None:
        self._calls.close()


class GroupServer(Protocol):
    """What LocalManagerClient calls of its group's ManagerServer, in process."""

    @property
    def world_size(self) -> int: ...
    def address(self) -> str: ...
    def run(self, coro: Any, timeout_s: float) -> Any: ...
    def submit(self, coro: Any) -> Future[Any]: ...
    def quorum(self, request: QuorumRequest, timeout_s: float | None) -> Any: ...
    def should_commit(self, group_rank: int, step: int, vote: bool, timeout_s: float) -> Any: ...
    def vote_alone(self, group_rank: int, step: int, vote: bool) -> bool: ...
    def checkpoint_metadata(self, rank: int) -> str: ...
    def kill(self, msg: str) -> None: ...


class LocalManagerClient:
    """ManagerClientProtocol for group rank 0, calling its ManagerServer in process.

    Running on the server's loop instead of a gRPC round trip over loopback
    takes two local RPCs off every step; errors are the same as over gRPC.
    """

    def __init__(self, server: GroupServer) -> None:
        self.addr = server.address()
        self._server = server

    def _run(self, coro: Any, timeout: timedelta) -> Any:
        # The coroutine bounds itself; this bound only guards against a
        # stopped or stuck loop, which nothing else would wake us from.
        try:
            return self._server.run(coro, timeout.total_seconds() + 5)
        except LoopStalledError as e:
            raise QuorumTimeoutError(f"manager server {self.addr}: {e}") from None

    def quorum(self, request: QuorumRequest, timeout: timedelta) -> QuorumResult:
        result: QuorumResult = self._run(
            self._server.quorum(request, timeout.total_seconds()), timeout
        )
        return result

    def quorum_future(self, request: QuorumRequest, timeout: timedelta) -> Future[QuorumResult]:
        """`quorum`, handed to the server's loop without waiting: its future
        completes on the loop (see torchft_like.manager.asking)."""
        coro = self._server.quorum(request, timeout.total_seconds())
        future: Future[QuorumResult] = self._server.submit(coro)
        return future

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        if self._server.world_size == 1:
            # A group of one rank: the vote is the decision. Skipping the hop
            # onto the loop and back saves two thread wake-ups every step.
            return self._server.vote_alone(group_rank, step, should_commit)
        coro = self._server.should_commit(group_rank, step, should_commit, timeout.total_seconds())
        return bool(self._run(coro, timeout))

    def checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        return self._server.checkpoint_metadata(rank)

    def kill(self, msg: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        async def kill() -> None:
            self._server.kill(msg)

        self._run(kill(), timeout)

    def close(self) -> None:
        pass
