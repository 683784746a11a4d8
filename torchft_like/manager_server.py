"""The per-group ManagerServer (hosted by group rank 0) and its client.

The server gathers one Quorum call from every rank of the group, asks the
lighthouse once for the whole group, and answers each rank with its own view
(torchft_like.recovery). It also collects the group's commit votes. It runs
on a private asyncio loop, so waiting never holds the GIL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
from grpc import aio

from lighthouse import auth
from lighthouse._aio import BackgroundLoop
from lighthouse._proto import torchft_pb2 as pb
from lighthouse._proto import torchft_pb2_grpc as pb_grpc
from lighthouse.address import advertised_host, join_host_port, parse_bind, url_to_target
from lighthouse.client import (
    CHANNEL_OPTIONS,
    AsyncLighthouseClient,
    check_reachable,
    map_rpc_error,
)
from lighthouse.decode_guard import add_servicer
from lighthouse.errors import LighthouseUnavailableError, QuorumError, QuorumTimeoutError
from lighthouse.quorum import Quorum, QuorumMember
from torchft_like.recovery import QuorumResult, compute_quorum_result, fingerprint_data

logger = logging.getLogger(__name__)


def retry_delay_s(num_failures: int) -> float:
    """Backoff before the next lighthouse attempt: 0.1 s doubling to 1 s."""
    return min(1.0, 0.1 * 2**num_failures)


def result_to_proto(r: QuorumResult) -> pb.ManagerQuorumResponse:
    return pb.ManagerQuorumResponse(
        quorum_id=r.quorum_id,
        recover_src_manager_address=r.recover_src_manager_address,
        recover_src_replica_rank=r.recover_src_replica_rank,
        recover_dst_replica_ranks=r.recover_dst_replica_ranks,
        store_address=r.store_address,
        max_step=r.max_step,
        max_replica_rank=r.max_replica_rank,
        max_world_size=r.max_world_size,
        replica_rank=r.replica_rank,
        replica_world_size=r.replica_world_size,
        heal=r.heal,
        commit_failures=r.commit_failures,
    )


def result_from_proto(m: pb.ManagerQuorumResponse) -> QuorumResult:
    return QuorumResult(
        quorum_id=m.quorum_id,
        replica_rank=m.replica_rank,
        replica_world_size=m.replica_world_size,
        store_address=m.store_address,
        max_step=m.max_step,
        max_replica_rank=m.max_replica_rank if m.HasField("max_replica_rank") else None,
        max_world_size=m.max_world_size,
        heal=m.heal,
        recover_src_manager_address=m.recover_src_manager_address,
        recover_src_replica_rank=(
            m.recover_src_replica_rank if m.HasField("recover_src_replica_rank") else None
        ),
        recover_dst_replica_ranks=tuple(m.recover_dst_replica_ranks),
        commit_failures=m.commit_failures,
    )


@dataclass
class _Round:
    """Calls of one collective gathering (a quorum or a commit vote) by group rank."""

    calls: dict[int, object] = field(default_factory=dict)
    futures: dict[int, asyncio.Future] = field(default_factory=dict)
    deadlines: dict[int, float] = field(default_factory=dict)
    """Deadline (monotonic) of each waiting call; the earliest bounds the whole
    wait. Per call, so that a call that gave up takes its deadline with it."""


class ManagerServer:
    """Hosted by group rank 0 of each replica group.

    Args:
        replica_id: this group's `{name}:{uuid}`.
        lighthouse_addr: URL of the lighthouse.
        hostname: how peers reach this machine.
        bind: `host:port` to listen on (port 0 picks one).
        store_addr: `host:port` of this group's TCPStore.
        world_size: ranks in this replica group.
        heartbeat_interval: period of the lighthouse heartbeats.
        connect_timeout: bound on reaching the lighthouse.
        quorum_retries: lighthouse quorum failures retried before the ranks see one.
        secret: the job's shared secret: required of our callers and sent to
            the lighthouse (lighthouse.auth); None: access control off.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        connect_timeout: timedelta = timedelta(seconds=10),
        quorum_retries: int = 0,
        secret: str | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be at least 1")
        self.replica_id = replica_id
        self._lighthouse_addr = lighthouse_addr
        self._store_addr = store_addr
        self._world_size = world_size
        self._heartbeat_interval = heartbeat_interval
        self._connect_timeout = connect_timeout
        self._quorum_retries = quorum_retries
        self._secret = secret
        self._checkpoint_metadata: dict[int, str] = {}
        self._quorum_round = _Round()
        self._votes: dict[int, _Round] = {}
        self._stopped = False
        host, port = parse_bind(bind)
        self._loop = BackgroundLoop(f"manager-server-{replica_id}")
        try:
            self._port = self._loop.run(self._start(host, port))
        except BaseException:
            self._loop.stop()
            raise
        self._address = f"http://{join_host_port(hostname or advertised_host(host), self._port)}"
        logger.info("[%s] manager server listening on %s", replica_id, self._address)

    async def _start(self, host: str, port: int) -> int:
        self._lighthouse = AsyncLighthouseClient(
            self._lighthouse_addr, self._connect_timeout, self._secret
        )
        self._server = aio.server(
            options=[("grpc.so_reuseport", 0)],
            interceptors=auth.server_interceptors(self._secret, "manager server"),
        )
        add_servicer(
            pb_grpc.add_ManagerServiceServicer_to_server, _ManagerServicer(self), self._server
        )
        bound = 0
        try:
            bound = self._server.add_insecure_port(join_host_port(host, port))
        except RuntimeError:
            pass
        if bound == 0:
            raise OSError(
                f"manager server cannot listen on {join_host_port(host, port)}: the port is in "
                "use; set TORCHFT_MANAGER_PORT to a free port or 0"
            )
        # Fail fast with the address when the lighthouse is not there at all.
        await self._lighthouse.heartbeat(self.replica_id, self._connect_timeout)
        await self._server.start()
        self._heartbeater = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        return bound

    def address(self) -> str:
        return self._address

    # ---- quorum --------------------------------------------------------------

    async def quorum(
        self, group_rank: int, req: pb.ManagerQuorumRequest, timeout_s: float | None
    ) -> QuorumResult:
        """Waits until every rank asked, then asks the lighthouse for the group."""
        self._check_rank(group_rank)
        for name in ("step", "commit_failures"):
            if getattr(req, name) < 0:
                raise ValueError(f"{name} ({getattr(req, name)}) must not be negative")
        self._checkpoint_metadata[group_rank] = req.checkpoint_metadata
        rnd = self._quorum_round
        if timeout_s is not None:
            rnd.deadlines[group_rank] = time.monotonic() + timeout_s
        future = asyncio.get_running_loop().create_future()
        old = rnd.futures.get(group_rank)
        if old is not None and not old.done():
            old.set_exception(QuorumError(f"group rank {group_rank} asked again; superseded"))
        rnd.calls[group_rank] = req
        rnd.futures[group_rank] = future
        if len(rnd.calls) == self._world_size:
            self._quorum_round = _Round()
            asyncio.get_running_loop().create_task(self._lighthouse_quorum(rnd))
        try:
            return await asyncio.shield(future)
        finally:
            if rnd.futures.get(group_rank) is future and not future.done():
                del rnd.calls[group_rank], rnd.futures[group_rank]
                rnd.deadlines.pop(group_rank, None)

    async def _lighthouse_quorum(self, rnd: _Round) -> None:
        calls: dict[int, pb.ManagerQuorumRequest] = rnd.calls  # type: ignore[assignment]
        reqs = list(calls.values())
        step = max(r.step for r in reqs)
        data = fingerprint_data(
            step, {g: r.fingerprint for g, r in calls.items() if r.step == step}, self._world_size
        )
        member = QuorumMember(
            replica_id=self.replica_id,
            address=self._address,
            store_address=self._store_addr,
            step=step,
            world_size=self._world_size,
            shrink_only=any(r.shrink_only for r in reqs),
            data=json.dumps(data) if data else "",
            commit_failures=max(r.commit_failures for r in reqs),
        )
        init_sync = any(r.init_sync for r in reqs)
        deadline = min(rnd.deadlines.values(), default=float("inf"))
        deadline = min(deadline, time.monotonic() + 24 * 3600.0)
        try:
            quorum = await self._quorum_with_retries(member, deadline)
        except Exception as e:
            for f in rnd.futures.values():
                if not f.done():
                    f.set_exception(e)
            return
        for rank, f in rnd.futures.items():
            if f.done():
                continue
            try:
                result = compute_quorum_result(quorum, self.replica_id, rank, init_sync)
            except ValueError as e:
                f.set_exception(QuorumError(str(e)))
                continue
            if result.divergence:
                logger.error("[%s] DIVERGENCE: %s", self.replica_id, result.divergence)
            f.set_result(result)

    async def _quorum_with_retries(self, member: QuorumMember, deadline: float) -> Quorum:
        """Asks the lighthouse until `deadline` (monotonic).

        An unreachable lighthouse (restarting, a network blip) is retried with
        backoff until the deadline, so the group waits out the outage and goes
        on when it is back instead of failing one step per attempt. Other
        failures are retried `quorum_retries` times.
        """
        attempt = 0
        outage_start: float | None = None
        num_unreachable = 0
        while True:
            # A little before the ranks' own deadline, so they get our error
            # (naming the lighthouse) rather than a bare deadline.
            remaining = max(deadline - time.monotonic() - 0.1, 0.001)
            try:
                quorum = await asyncio.wait_for(
                    self._lighthouse.quorum(member, timedelta(seconds=remaining)), remaining
                )
            except asyncio.TimeoutError:
                text = f"lighthouse {self._lighthouse_addr} %s until the quorum deadline"
                if outage_start is not None:
                    raise LighthouseUnavailableError(text % "unreachable") from None
                raise QuorumTimeoutError(text % "gave no quorum") from None
            except LighthouseUnavailableError as e:
                if outage_start is None:
                    outage_start = time.monotonic()
                    logger.warning(
                        "[%s] lighthouse unreachable, retrying for up to %.1f s: %s",
                        self.replica_id,
                        remaining,
                        e,
                    )
                delay = retry_delay_s(num_unreachable)
                num_unreachable += 1
                if time.monotonic() + delay >= deadline:
                    raise
                await asyncio.sleep(delay)
                continue
            except QuorumError as e:
                if attempt >= self._quorum_retries:
                    raise
                attempt += 1
                logger.warning(
                    "[%s] lighthouse quorum failed (attempt %d of %d), retrying: %s",
                    self.replica_id,
                    attempt,
                    self._quorum_retries + 1,
                    e,
                )
                await asyncio.sleep(retry_delay_s(attempt - 1))
                continue
            if outage_start is not None:
                logger.info(
                    "[%s] lighthouse reachable again after %.1f s",
                    self.replica_id,
                    time.monotonic() - outage_start,
                )
            return quorum

    # ---- commit vote -------------------------------------------------------

    async def should_commit(self, group_rank: int, step: int, vote: bool) -> bool:
        """True for every rank only if every rank of the group voted True."""
        self._check_rank(group_rank)
        rnd = self._votes.setdefault(step, _Round())
        future = asyncio.get_running_loop().create_future()
        rnd.calls[group_rank] = vote
        rnd.futures[group_rank] = future
        if len(rnd.calls) == self._world_size:
            del self._votes[step]
            decision = all(rnd.calls.values())
            if not decision:
                no = sorted(r for r, v in rnd.calls.items() if not v)
                logger.info(
                    "[%s step=%d] commit refused: group ranks %s voted no",
                    self.replica_id,
                    step,
                    no,
                )
            for f in rnd.futures.values():
                if not f.done():
                    f.set_result(decision)
        try:
            return await asyncio.shield(future)
        finally:
            if not future.done() and rnd.futures.get(group_rank) is future:
                del rnd.calls[group_rank], rnd.futures[group_rank]
                # An abandoned vote must not leave its step behind: fuzzed or
                # stale steps would otherwise pile up for good.
                if not rnd.calls and self._votes.get(step) is rnd:
                    del self._votes[step]

    def checkpoint_metadata(self, rank: int) -> str | None:
        return self._checkpoint_metadata.get(rank)

    def _check_rank(self, group_rank: int) -> None:
        if not 0 <= group_rank < self._world_size:
            raise ValueError(f"group_rank ({group_rank}) must be in [0, {self._world_size})")

    # ---- background ----------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Heartbeats on one stream (its closing tells the lighthouse at once
        that we died); unary calls to a lighthouse without HeartbeatStream."""
        failing = False
        use_stream = True
        interval = self._heartbeat_interval.total_seconds()
        timeout = timedelta(seconds=max(1.0, 10 * interval))
        while not self._stopped:
            try:
                if use_stream and not await self._lighthouse.stream_heartbeat(
                    self.replica_id, timeout
                ):
                    use_stream = False
                    logger.info(
                        "[%s] the lighthouse has no HeartbeatStream; unary heartbeats",
                        self.replica_id,
                    )
                if not use_stream:
                    await self._lighthouse.heartbeat(self.replica_id, timeout)
                if failing:
                    logger.info("[%s] lighthouse heartbeats succeed again", self.replica_id)
                failing = False
            except Exception as e:
                if not failing:
                    logger.warning(
                        "[%s] lighthouse heartbeat failed, will keep trying: %s", self.replica_id, e
                    )
                failing = True
            await asyncio.sleep(interval)

    def shutdown(self, leave: bool = True) -> None:
        """Stops serving; with `leave`, first tells the lighthouse we go on
        purpose so the other groups do not wait for our heartbeat to expire."""
        if self._stopped:
            return
        self._stopped = True
        self._loop.run(self._stop(leave), timeout=15)
        self._loop.stop()

    async def _stop(self, leave: bool) -> None:
        # Heartbeats end first: one that reached the lighthouse after our Leave
        # would make us healthy again, and the others wait out its timeout.
        # Closing the stream first also fails a write in flight, which a
        # cancelled task alone may keep waiting on.
        self._lighthouse.close_heartbeat_stream()
        self._heartbeater.cancel()
        # On Python < 3.12 asyncio.wait_for can swallow a cancel that races its
        # result; the loop then ends at its next check of _stopped.
        await asyncio.wait([self._heartbeater], timeout=1.0)
        if leave:
            try:
                await self._lighthouse.leave(self.replica_id, self._connect_timeout)
            except Exception as e:
                logger.warning(
                    "[%s] could not tell the lighthouse we leave: %s", self.replica_id, e
                )
        await self._server.stop(grace=None)
        await self._lighthouse.close()


class _ManagerServicer(pb_grpc.ManagerServiceServicer):
    """Thin: converts, calls the server, converts back, maps errors."""

    def __init__(self, server: ManagerServer) -> None:
        self._s = server

    async def _bounded(self, coro, context: aio.ServicerContext):  # type: ignore[no-untyped-def]
        try:
            return await asyncio.wait_for(coro, context.time_remaining())
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while waiting for the group"
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QuorumError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Quorum(
        self, request: pb.ManagerQuorumRequest, context: aio.ServicerContext
    ) -> pb.ManagerQuorumResponse:
        result = await self._bounded(
            self._s.quorum(request.group_rank, request, context.time_remaining()), context
        )
        return result_to_proto(result)

    async def ShouldCommit(
        self, request: pb.ShouldCommitRequest, context: aio.ServicerContext
    ) -> pb.ShouldCommitResponse:
        decision = await self._bounded(
            self._s.should_commit(request.group_rank, request.step, request.should_commit), context
        )
        return pb.ShouldCommitResponse(should_commit=decision)

    async def CheckpointMetadata(
        self, request: pb.CheckpointMetadataRequest, context: aio.ServicerContext
    ) -> pb.CheckpointMetadataResponse:
        metadata = self._s.checkpoint_metadata(request.rank)
        if metadata is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"group rank {request.rank} of {self._s.replica_id} has not asked for a quorum yet",
            )
        return pb.CheckpointMetadataResponse(checkpoint_metadata=metadata)

    async def Kill(self, request: pb.KillRequest, context: aio.ServicerContext) -> pb.KillResponse:
        logger.error("[%s] killed by request: %s", self._s.replica_id, request.msg)
        asyncio.get_running_loop().call_later(0.1, os._exit, 1)
        return pb.KillResponse()


class ManagerClient:
    """Blocking client of a ManagerServer, used by every rank of the group.

    `secret`: the job's shared secret, sent with every call (lighthouse.auth).
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta = timedelta(seconds=10),
        secret: str | None = None,
    ) -> None:
        self.addr = addr
        self._connect_timeout = connect_timeout
        self._target = url_to_target(addr)
        self._channel = auth.intercept_channel(
            grpc.insecure_channel(self._target, options=CHANNEL_OPTIONS), secret
        )
        self._stub = pb_grpc.ManagerServiceStub(self._channel)
        self._connected = False

    def _call(self, method, request, timeout: timedelta, what: str):  # type: ignore[no-untyped-def]
        if not self._connected:
            check_reachable(self._target, f"manager server {self.addr}", self._connect_timeout)
            self._connected = True
        try:
            return method(request, timeout=timeout.total_seconds())
        except grpc.RpcError as e:
            self._connected = e.code() != grpc.StatusCode.UNAVAILABLE
            raise map_rpc_error(e, f"manager server {self.addr}", what) from None

    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: timedelta,
        init_sync: bool = True,
        commit_failures: int = 0,
        fingerprint: str = "",
    ) -> QuorumResult:
        request = pb.ManagerQuorumRequest(
            group_rank=group_rank,
            step=step,
            checkpoint_metadata=checkpoint_metadata,
            shrink_only=shrink_only,
            init_sync=init_sync,
            commit_failures=commit_failures,
            fingerprint=fingerprint,
        )
        return self._send_quorum(request, timeout)

    def _send_quorum(self, request: pb.ManagerQuorumRequest, timeout: timedelta) -> QuorumResult:
        return result_from_proto(self._call(self._stub.Quorum, request, timeout, "Quorum"))

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        request = pb.CheckpointMetadataRequest(rank=rank)
        return self._call(
            self._stub.CheckpointMetadata, request, timeout, "CheckpointMetadata"
        ).checkpoint_metadata

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        request = pb.ShouldCommitRequest(
            should_commit=should_commit, group_rank=group_rank, step=step
        )
        return self._call(self._stub.ShouldCommit, request, timeout, "ShouldCommit").should_commit

    def _kill(self, msg: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        self._call(self._stub.Kill, pb.KillRequest(msg=msg), timeout, "Kill")

    def close(self) -> None:
        self._channel.close()


class LocalManagerClient(ManagerClient):
    """ManagerClient whose calls go straight to a ManagerServer in this process.

    Group rank 0 hosts the server; running on its loop instead of a gRPC
    round trip over loopback takes two local RPCs off every step.
    """

    def __init__(self, server: ManagerServer) -> None:
        self.addr = server.address()
        self._server = server

    def _run(self, coro, timeout: timedelta, what: str):  # type: ignore[no-untyped-def]
        async def bounded():  # type: ignore[no-untyped-def]
            return await asyncio.wait_for(coro, timeout.total_seconds())

        try:
            # Bounded here too: if the server's loop stops, nothing else would wake us.
            return self._server._loop.run(bounded(), timeout=timeout.total_seconds() + 5)
        except (asyncio.TimeoutError, concurrent.futures.TimeoutError):  # distinct on 3.10
            raise QuorumTimeoutError(
                f"{what} at manager server {self.addr}: deadline passed"
            ) from None

    def _send_quorum(self, request: pb.ManagerQuorumRequest, timeout: timedelta) -> QuorumResult:
        coro = self._server.quorum(request.group_rank, request, timeout.total_seconds())
        return self._run(coro, timeout, "Quorum")

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        coro = self._server.should_commit(group_rank, step, should_commit)
        return self._run(coro, timeout, "ShouldCommit")

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        metadata = self._server.checkpoint_metadata(rank)
        if metadata is None:
            raise QuorumError(f"group rank {rank} has not asked for a quorum yet")
        return metadata

    def close(self) -> None:
        pass
