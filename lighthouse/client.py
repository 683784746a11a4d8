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
from grpc import aio

from lighthouse import wire
from lighthouse.core.quorum import Quorum, QuorumMember
from lighthouse.core.views import QuorumResult
from lighthouse.loop import wait_within
from lighthouse.rpc import auth
from lighthouse.rpc.address import url_to_target
from lighthouse.rpc.channel import BlockingCalls, aio_channel, tls_refusal, unreachable
from lighthouse.rpc.errors import (
    FreshStartRefusedError,
    QuorumError,
    QuorumTimeoutError,
    error_of,
    from_rpc_error,
)
from lighthouse.rpc.lean import client as lean_client
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig, check_scheme

logger = logging.getLogger(__name__)

FRESH_START_RETRY_S = 0.1
"""Pause before asking again after a refused fresh start."""
QUORUM_METHOD = "/torchft.LighthouseService/Quorum"
HEARTBEAT_PACED_METHOD = "/torchft.LighthouseService/HeartbeatPaced"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""Where the library's Manager finds the lighthouse (read by torchft_like.manager)."""


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
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta = timedelta(seconds=10),
        secret: str | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.addr = addr
        target = lighthouse_target(addr, tls)
        self._calls = BlockingCalls(target, f"lighthouse {addr}", connect_timeout, secret, tls)
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
    """asyncio twin of LighthouseClient, for servers that run on an event loop."""

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta = timedelta(seconds=10),
        secret: str | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.addr = addr
        self._connect_timeout = connect_timeout
        self._tls = tls
        self._target = lighthouse_target(addr, tls)
        self._channel = aio_channel(self._target, secret, tls)
        self._stub = pb_grpc.LighthouseServiceStub(self._channel)
        self._lean = (
            None
            if tls is not None or not lean_client.usable(self._target)
            else lean_client.LeanChannel(self._target, auth.metadata(secret))
        )
        """The Quorum call, a group's one call a step, goes here first (plain
        text, no proxy for this host: lean_client.usable), and so does the
        heartbeat stream while no grpcio one is open."""
        self._lean_stream: lean_client.LeanStream | None = None
        self._lean_paced = self._lean is not None
        """Whether to try HeartbeatPaced on the lean client (False once the
        lighthouse said it has none: grpcio's path then finds out what it has)."""
        self._heartbeat_call: Any = None
        self._paced = True
        """Whether to heartbeat on HeartbeatPaced (False: on HeartbeatStream,
        for a lighthouse without it)."""
        self._advice_reader: asyncio.Task[None] | None = None
        self._advice_ms = 0
        self.on_gone: Callable[[int, tuple[str, ...]], None] | None = None
        """Called on the event loop with (quorum_id, replica ids) for each gone
        notice on our HeartbeatPaced stream (lighthouse.core.gone)."""

    async def _ensure_connected(self, limit: timedelta | None = None) -> None:
        """Waits for the connection, at most the connect timeout (or `limit` if shorter)."""
        state = self._channel.get_state(try_to_connect=True)
        if state == grpc.ChannelConnectivity.READY:
            return
        bound = min(self._connect_timeout, limit) if limit is not None else self._connect_timeout
        if self._tls is not None:  # a failed handshake would look like a wait until `bound`
            what, bound_s = f"lighthouse {self.addr}", bound.total_seconds()
            refused = await asyncio.to_thread(tls_refusal, self._target, what, self._tls, bound_s)
            if refused is not None:
                raise refused
        await wait_within(
            self._channel.channel_ready(),
            bound.total_seconds(),
            lambda: unreachable(f"lighthouse {self.addr}", bound),
        )

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
        logged = False
        while True:
            try:
                response = await self._quorum_once(request, deadline)
            except FreshStartRefusedError as e:
                if not logged:
                    logged = True
                    logger.warning("[%s] not training, waiting: %s", member.replica_id, e)
                if deadline - time.monotonic() < 2 * FRESH_START_RETRY_S:
                    raise
                await asyncio.sleep(FRESH_START_RETRY_S)
                continue
            views = tuple(wire.result_from_proto(v) for v in response.views)
            return wire.quorum_from_proto(response.quorum), views

    async def _quorum_once(
        self, request: pb.LighthouseQuorumRequest, deadline: float
    ) -> pb.LighthouseQuorumResponse:
        if self._lean is not None:
            try:
                answer = await self._lean.unary(
                    QUORUM_METHOD,
                    request.SerializeToString(),
                    max(deadline - time.monotonic(), 0.001),
                )
                return pb.LighthouseQuorumResponse.FromString(answer)
            except lean_client.CallFailed as e:
                raise error_of(
                    e.code, f"Quorum at lighthouse {self.addr} failed: {e.details}"
                ) from None
            except lean_client.Unavailable:
                pass  # grpcio's channel waits for the lighthouse, or says why not
        await self._ensure_connected(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        try:
            response: pb.LighthouseQuorumResponse = await self._stub.Quorum(
                request, timeout=max(deadline - time.monotonic(), 0.001)
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"lighthouse {self.addr}", "Quorum") from None
        return response

    async def heartbeat(self, replica_id: str, timeout: timedelta) -> None:
        await self._ensure_connected()
        try:
            await self._stub.Heartbeat(
                pb.LighthouseHeartbeatRequest(replica_id=replica_id),
                timeout=timeout.total_seconds(),
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"lighthouse {self.addr}", "Heartbeat") from None

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
        if self._heartbeat_call is None and self._lean_paced:
            if await self._lean_heartbeat(replica_id, timeout):
                return True
        await self._ensure_connected()
        if self._heartbeat_call is None:
            if self._paced:
                self._heartbeat_call = self._stub.HeartbeatPaced()
                self._advice_reader = asyncio.get_running_loop().create_task(
                    self._read_advice(self._heartbeat_call)
                )
            else:
                self._heartbeat_call = self._stub.HeartbeatStream()
        call = self._heartbeat_call
        error: grpc.RpcError | None = None
        if not call.done():
            try:
                request = pb.LighthouseHeartbeatRequest(replica_id=replica_id)
                await asyncio.wait_for(call.write(request), timeout.total_seconds())
                return True
            except grpc.RpcError as e:
                error = e
            except asyncio.InvalidStateError:
                pass  # finished meanwhile: its status says why
            except asyncio.TimeoutError:
                error = aio.AioRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    aio.Metadata(),
                    aio.Metadata(),
                    f"heartbeat not sent within {timeout.total_seconds():.1f} s",
                )
        self.close_heartbeat_stream()
        if error is None:
            code, details = await call.code(), await call.details()
            error = aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details)
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            if self._paced:  # an older torchft_like lighthouse: the unpaced stream
                self._paced = False
                return await self.stream_heartbeat(replica_id, timeout)
            return False
        raise from_rpc_error(error, f"lighthouse {self.addr}", "HeartbeatStream") from None

    async def _lean_heartbeat(self, replica_id: str, timeout: timedelta) -> bool:
        """One heartbeat on our HeartbeatPaced stream over the lean client,
        which costs the loop a fraction of grpcio's (lean_client). False
        where it cannot go that way: grpcio's stream then carries it, and
        keeps it until that stream fails.

        Raises:
            as stream_heartbeat: the status the last lean stream ended with.
        """
        assert self._lean is not None
        stream = self._lean_stream
        if stream is not None and stream.ended.done():
            error = stream.ended.exception()
            self._drop_lean_stream()
            stream = None
            if isinstance(error, lean_client.CallFailed):
                if error.code == grpc.StatusCode.UNIMPLEMENTED:
                    self._lean_paced = False
                    return False
                what = f"HeartbeatStream at lighthouse {self.addr} failed: {error.details}"
                raise error_of(error.code, what)
        try:  # a lost or ended stream: a new one (a restarted lighthouse)
            if stream is None:
                stream = self._lean_stream = await self._lean.stream(
                    HEARTBEAT_PACED_METHOD, self._take_advice_bytes, timeout.total_seconds()
                )
            stream.write(pb.LighthouseHeartbeatRequest(replica_id=replica_id).SerializeToString())
        except lean_client.Unavailable:
            self._drop_lean_stream()
            return False
        return True

    def _drop_lean_stream(self) -> None:
        if self._lean_stream is not None:
            self._lean_stream.cancel()
            self._lean_stream = None
            self._advice_ms = 0

    def _take_advice_bytes(self, message: bytes) -> None:
        try:
            advice = pb.LighthouseHeartbeatAdvice.FromString(message)
        except Exception:  # a malformed answer: the stream's end will say more
            logger.exception("a malformed heartbeat advice from lighthouse %s", self.addr)
            return
        self._take_advice(advice)

    def _take_advice(self, advice: Any) -> None:
        """Keeps the advised period and hands a gone notice to `on_gone`."""
        self._advice_ms = max(0, int(advice.interval_ms))
        if advice.HasField("gone") and self.on_gone is not None:
            try:
                self.on_gone(int(advice.gone.quorum_id), tuple(advice.gone.replica_ids))
            except Exception:  # the advice must still be read
                logger.exception("handling a gone notice failed")

    async def _read_advice(self, call: Any) -> None:
        """Takes each advice of a HeartbeatPaced call (_take_advice); its end
        (an error included) is the writer's to report."""
        try:
            async for advice in call:
                self._take_advice(advice)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass

    def advised_interval(self) -> timedelta | None:
        """The heartbeat period the lighthouse last advised on our stream;
        None before any advice, and on a lighthouse that gives none."""
        return timedelta(milliseconds=self._advice_ms) if self._advice_ms else None

    def heartbeat_stream_open(self) -> bool:
        """Whether our heartbeat stream is open (then the lighthouse sees our
        death at once and can push gone notices on it)."""
        lean = self._lean_stream
        if lean is not None and not lean.ended.done():
            return True
        return self._heartbeat_call is not None and not self._heartbeat_call.done()

    def close_heartbeat_stream(self) -> None:
        """Ends our heartbeat stream; the lighthouse takes it as us being gone
        unless we said Leave first."""
        self._drop_lean_stream()
        if self._heartbeat_call is not None:
            self._heartbeat_call.cancel()
            self._heartbeat_call = None
        if self._advice_reader is not None:
            self._advice_reader.cancel()
            self._advice_reader = None
        self._advice_ms = 0

    async def leave(self, replica_id: str, timeout: timedelta) -> None:
        """See LighthouseClient.leave; the whole call, connecting included,
        takes at most `timeout` (a stopped lighthouse must not hold us up)."""
        start = time.monotonic()
        await self._ensure_connected(timeout)
        left_s = max(timeout.total_seconds() - (time.monotonic() - start), 0.001)
        try:
            await self._stub.Leave(pb.LighthouseLeaveRequest(replica_id=replica_id), timeout=left_s)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise from_rpc_error(e, f"lighthouse {self.addr}", "Leave") from None

    async def close(self) -> None:
        self.close_heartbeat_stream()
        if self._lean is not None:
            self._lean.close()
        await self._channel.close()
