"""Clients of the lighthouse: a blocking one and an asyncio one.

Both check the connection first, bounded by `connect_timeout`, so an
unreachable lighthouse is reported within that time instead of after the
(much longer) quorum timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc

from lighthouse import wire
from lighthouse.core.jobs import DEFAULT_JOB, check_job_id
from lighthouse.core.quorum import Quorum, QuorumMember
from lighthouse.core.views import QuorumResult
from lighthouse.rpc.address import url_to_target
from lighthouse.rpc.async_calls import AsyncCalls, Stream
from lighthouse.rpc.channel import BlockingCalls
from lighthouse.rpc.errors import (
    FreshStartRefusedError,
    QuorumError,
    QuorumTimeoutError,
    from_rpc_error,
)
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig, check_scheme

logger = logging.getLogger(__name__)

FRESH_START_RETRY_S = 0.1
"""Pause before asking again after a refused fresh start."""
QUORUM_METHOD = "/torchft.LighthouseService/Quorum"
HEARTBEAT_METHOD = "/torchft.LighthouseService/Heartbeat"
HEARTBEAT_STREAM_METHOD = "/torchft.LighthouseService/HeartbeatStream"
HEARTBEAT_PACED_METHOD = "/torchft.LighthouseService/HeartbeatPaced"
LEAVE_METHOD = "/torchft.LighthouseService/Leave"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""Where the library's Manager finds the lighthouse (read by torchft_like.manager)."""


def _peer(addr: str, job_id: str) -> str:
    """How errors name the lighthouse: with the job, unless it is the default one."""
    return f"lighthouse {addr}" + ("" if job_id == DEFAULT_JOB else f" (job {job_id})")


def lighthouse_target(addr: str, tls: TLSConfig | None = None) -> str:
    """The gRPC target of a lighthouse URL; a bad one (or one whose scheme
    disagrees with `tls`) names TORCHFT_LIGHTHOUSE and the fix."""
    check_scheme(addr, tls, f"lighthouse address ({LIGHTHOUSE_ENV} or lighthouse_addr)")
    return url_to_target(
        addr,
        f"lighthouse address ({LIGHTHOUSE_ENV} or lighthouse_addr)",
        f"set {LIGHTHOUSE_ENV} to the URL torchft-lighthouse printed at start, with its "
        "port, e.g. http://lighthouse-host:29510",
    )


class LighthouseClient:
    """Blocking client. Quorum blocks until a quorum containing us is issued.

    Args:
        addr: the lighthouse's URL, e.g. http://host:29510.
        connect_timeout: how long the first call waits for the connection.
        secret: the job's shared secret, sent with every call (lighthouse.rpc.auth).
        tls: connect over TLS (lighthouse.rpc.tls); `addr` is then https://.
        job_id: the job on the lighthouse (lighthouse.core.jobs); None: the default job.

    Raises:
        ValueError: a bad address or job id.
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta = timedelta(seconds=10),
        secret: str | None = None,
        tls: TLSConfig | None = None,
        job_id: str | None = None,
    ) -> None:
        self.addr = addr
        self.job_id = DEFAULT_JOB if job_id is None else check_job_id(job_id)
        target = lighthouse_target(addr, tls)
        self._calls = BlockingCalls(
            target, _peer(addr, self.job_id), connect_timeout, secret, tls, self.job_id
        )
        self._stub = pb_grpc.LighthouseServiceStub(self._calls.channel)

    def quorum(
        self,
        replica_id: str,
        timeout: timedelta,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 1,
        shrink_only: bool = False,
        data: dict[str, Any] | str | None = None,
        commit_failures: int = 0,
    ) -> Quorum:
        """Joins the next quorum as `replica_id`; the other arguments describe
        us to the other members (see QuorumMember). `data` is JSON-encoded;
        each participant's comes back decoded (a dict, or None when empty).

        Raises:
            QuorumTimeoutError: no quorum with us was issued within `timeout`.
            LighthouseUnavailableError: the lighthouse cannot be reached.
            ValueError: the lighthouse refused the request as malformed.
        """
        member = QuorumMember(
            replica_id=replica_id,
            address=address,
            store_address=store_address,
            step=step,
            world_size=world_size,
            shrink_only=shrink_only,
            data=wire.encode_data(data),
            commit_failures=commit_failures,
        )
        request = pb.LighthouseQuorumRequest(requester=wire.member_to_proto(member))
        response = self._calls.call(self._stub.Quorum, request, timeout.total_seconds(), "Quorum")
        quorum = wire.quorum_from_proto(response.quorum)
        # pytorch/torchft's client hands out `data` decoded; our servers keep
        # the text (AsyncLighthouseClient), which they only forward or parse.
        members = tuple(
            dataclasses.replace(m, data=wire.decode_data(m.data))  # type: ignore[arg-type]
            for m in quorum.participants
        )
        return dataclasses.replace(quorum, participants=members)

    def heartbeat(self, replica_id: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        request = pb.LighthouseHeartbeatRequest(replica_id=replica_id)
        self._calls.call(self._stub.Heartbeat, request, timeout.total_seconds(), "Heartbeat")

    def leave(self, replica_id: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Tells the lighthouse we stop on purpose. A lighthouse that does not
        know Leave (pytorch/torchft's) is fine: our heartbeats just expire."""
        request = pb.LighthouseLeaveRequest(replica_id=replica_id)
        unimplemented = (grpc.StatusCode.UNIMPLEMENTED,)
        self._calls.call(self._stub.Leave, request, timeout.total_seconds(), "Leave", unimplemented)

    def take_replica_group(
        self,
        spare_id: str,
        wanted: str = "",
        timeout: timedelta | None = None,
        poll: timedelta = timedelta(seconds=30),
    ) -> str:
        """Blocks until the lighthouse lets us train as a replica group and
        returns its name: `wanted` if no live replica has it, else (as a hot
        spare) the name of the next group that dies. Every rank of one spare
        passes the same `spare_id` and gets the same name. A lighthouse
        restart or a network blip is waited out, up to `timeout` (None: for ever).

        Raises:
            QuorumTimeoutError: no group within `timeout`.
            QuorumError: the lighthouse does not serve spares (pytorch/torchft's).
            ValueError, PermissionError: the lighthouse refused the request.
        """
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        retried = (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.ABORTED,
        )
        while True:
            left_s = poll.total_seconds()
            if deadline is not None:
                left_s = min(left_s, deadline - time.monotonic())
                if left_s <= 0:
                    raise QuorumTimeoutError(
                        f"lighthouse {self.addr} gave spare {spare_id} no replica group "
                        f"within {timeout}: no group died (and {wanted or 'no group'} was wanted)"
                    )
            try:
                response = self._stub.TakeReplicaGroup(
                    pb.TakeReplicaGroupRequest(spare_id=spare_id, wanted=wanted), timeout=left_s
                )
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise QuorumError(
                        f"lighthouse {self.addr} does not serve hot spares (TakeReplicaGroup; "
                        "pytorch/torchft's lighthouse does not): run torchft_like's lighthouse, "
                        "or start this group without asking for a spare's place"
                    ) from None
                if e.code() not in retried:
                    raise from_rpc_error(e, f"lighthouse {self.addr}", "TakeReplicaGroup") from None
                time.sleep(0.1)  # the lighthouse is restarting, or the network blinked
                continue
            if response.replica_group:
                return str(response.replica_group)

    def close(self) -> None:
        self._calls.close()


class AsyncLighthouseClient:
    """asyncio twin of LighthouseClient, for servers that run on an event loop.

    Every call goes through one AsyncCalls (lighthouse.rpc.async_calls): our
    own gRPC client where it can, grpcio's where it cannot."""

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta = timedelta(seconds=10),
        secret: str | None = None,
        tls: TLSConfig | None = None,
        job_id: str | None = None,
    ) -> None:
        self.addr = addr
        self.job_id = DEFAULT_JOB if job_id is None else check_job_id(job_id)
        target = lighthouse_target(addr, tls)
        self._calls = AsyncCalls(
            target, _peer(addr, self.job_id), connect_timeout, secret, tls, self.job_id
        )
        self._stream: Stream | None = None
        self._paced = True
        """Whether to heartbeat on HeartbeatPaced (False: on HeartbeatStream,
        for a lighthouse without it)."""
        self._advice_ms = 0
        self.on_gone: Callable[[int, tuple[str, ...]], None] | None = None
        """Called on the event loop with (quorum_id, replica ids) for each gone
        notice on our HeartbeatPaced stream (lighthouse.core.gone)."""

    async def quorum(self, member: QuorumMember, timeout: timedelta) -> Quorum:
        """Joins the next quorum; the whole call, connecting included, takes at most `timeout`.

        A refused fresh start (FreshStartRefusedError, which the lighthouse
        answers a held call with after a few seconds) is logged at once and
        asked again until `timeout`: the group waits for a peer to heal from.
        """
        quorum, _ = await self.quorum_view(member, timeout, None)
        return quorum

    async def quorum_view(
        self, member: QuorumMember, timeout: timedelta, init_sync: bool | None
    ) -> tuple[Quorum, tuple[QuorumResult, ...]]:
        """`quorum`, asking (unless `init_sync` is None) for the group's view:
        each of its `member.world_size` group ranks' share, in rank order,
        and the quorum without its members. A lighthouse that does not know
        views (pytorch/torchft's) answers with the members and no views."""
        deadline = time.monotonic() + timeout.total_seconds()
        request = pb.LighthouseQuorumRequest(requester=wire.member_to_proto(member))
        if init_sync is not None:
            request.view.init_sync = init_sync
        raw = request.SerializeToString()
        logged = False
        while True:
            try:
                answer = await self._calls.unary(QUORUM_METHOD, raw, deadline, "Quorum")
            except FreshStartRefusedError as e:
                if not logged:
                    logged = True
                    logger.warning(
                        "replica group %s not training, waiting: %s", member.replica_id, e
                    )
                if deadline - time.monotonic() < 2 * FRESH_START_RETRY_S:
                    raise
                await asyncio.sleep(FRESH_START_RETRY_S)
                continue
            response = pb.LighthouseQuorumResponse.FromString(answer or b"")
            views = tuple(wire.result_from_proto(v) for v in response.views)
            return wire.quorum_from_proto(response.quorum), views

    async def heartbeat(self, replica_id: str, timeout: timedelta) -> None:
        request = pb.LighthouseHeartbeatRequest(replica_id=replica_id).SerializeToString()
        deadline = time.monotonic() + timeout.total_seconds()
        await self._calls.unary(HEARTBEAT_METHOD, request, deadline, "Heartbeat")

    async def stream_heartbeat(self, replica_id: str, timeout: timedelta) -> bool:
        """Sends one heartbeat on our heartbeat stream, opening it first if needed.

        One long-lived call costs the lighthouse far less than a unary call
        per heartbeat, and its closing (our process died) tells the lighthouse
        at once that we are gone. After an error the next call opens a new
        stream (a restarted lighthouse). The stream is HeartbeatPaced, whose
        answers say how often the lighthouse wants heartbeats (see
        advised_interval), or HeartbeatStream for a lighthouse without it.

        Returns:
            False if the lighthouse knows neither (it answered UNIMPLEMENTED,
            as pytorch/torchft's does): use heartbeat() instead. A write may
            be accepted before that answer arrives, so the False can come on
            a later call.

        Raises:
            LighthouseUnavailableError, QuorumTimeoutError, QuorumError: the
            stream failed; see lighthouse.rpc.errors.
        """
        if self._stream is None:
            method = HEARTBEAT_PACED_METHOD if self._paced else HEARTBEAT_STREAM_METHOD
            on_message = self._take_advice_bytes if self._paced else _ignore
            self._stream = await self._calls.stream(method, on_message, timeout.total_seconds())
        stream = self._stream
        request = pb.LighthouseHeartbeatRequest(replica_id=replica_id).SerializeToString()
        if await stream.write(request, timeout.total_seconds()):
            return True
        status = await stream.status()
        self.close_heartbeat_stream()
        if status[0] == grpc.StatusCode.UNIMPLEMENTED:
            if self._paced:  # an older torchft_like lighthouse: the unpaced stream
                self._paced = False
                return await self.stream_heartbeat(replica_id, timeout)
            return False
        raise self._calls.error(status, "HeartbeatStream")

    def _take_advice_bytes(self, message: bytes) -> None:
        """Keeps the advised period and hands a gone notice to `on_gone`."""
        try:
            advice = pb.LighthouseHeartbeatAdvice.FromString(message)
        except Exception:  # a malformed answer: the stream's end will say more
            logger.exception("a malformed heartbeat advice from lighthouse %s", self.addr)
            return
        self._advice_ms = max(0, int(advice.interval_ms))
        if advice.HasField("gone") and self.on_gone is not None:
            try:
                self.on_gone(int(advice.gone.quorum_id), tuple(advice.gone.replica_ids))
            except Exception:  # the advice must still be read
                logger.exception("handling a gone notice failed")

    def advised_interval(self) -> timedelta | None:
        """The heartbeat period the lighthouse last advised on our stream;
        None before any advice, and on a lighthouse that gives none."""
        return timedelta(milliseconds=self._advice_ms) if self._advice_ms else None

    def heartbeat_stream_open(self) -> bool:
        """Whether our heartbeat stream is open (then the lighthouse sees our
        death at once and can push gone notices on it)."""
        return self._stream is not None and self._stream.open()

    def close_heartbeat_stream(self) -> None:
        """Ends our heartbeat stream; the lighthouse takes it as us being gone
        unless we said Leave first."""
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        self._advice_ms = 0

    async def leave(self, replica_id: str, timeout: timedelta) -> None:
        """See LighthouseClient.leave; the whole call, connecting included,
        takes at most `timeout` (a stopped lighthouse must not hold us up)."""
        request = pb.LighthouseLeaveRequest(replica_id=replica_id).SerializeToString()
        deadline = time.monotonic() + timeout.total_seconds()
        unimplemented = (grpc.StatusCode.UNIMPLEMENTED,)
        await self._calls.unary(LEAVE_METHOD, request, deadline, "Leave", unimplemented)

    async def close(self) -> None:
        self.close_heartbeat_stream()
        await self._calls.close()


def _ignore(message: bytes) -> None:
    """HeartbeatStream's one answer, at its end: nothing in it."""
