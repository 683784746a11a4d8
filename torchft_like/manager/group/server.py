"""The per-group ManagerServer, hosted by group rank 0: the group's gatherings.

The server gathers one Quorum call from every rank of the group, asks the
lighthouse once for the whole group (group_request, through its session),
and answers each rank with its share of the quorum (lighthouse.core.views).
It also collects the group's commit votes. It runs on a private asyncio
loop, so waiting never holds the GIL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

from lighthouse.core.views import QuorumResult
from lighthouse.loop import BackgroundLoop, wait_for_future
from lighthouse.rpc import auth, serve
from lighthouse.rpc.address import advertised_host, join_host_port, parse_bind
from lighthouse.rpc.errors import (
    NotServedError,
    QuorumError,
    QuorumTimeoutError,
)
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig, scheme
from torchft_like.manager import threads
from torchft_like.manager.group.gathering import Round
from torchft_like.manager.group.group_request import QuorumRequest, merge_requests
from torchft_like.manager.group.log import GroupLog
from torchft_like.manager.group.quorum_gate import QuorumGate
from torchft_like.manager.group.servicer import ManagerServicer
from torchft_like.manager.group.session import GoneListener, LighthouseSession

__all__ = ["ManagerServer"]

logger = logging.getLogger(__name__)

MAX_WAIT_S = 24 * 3600.0
"""Bound of a call that came without a deadline."""


class ManagerServer:
    """Hosted by group rank 0 of each replica group.

    Args:
        replica_id: this group's `{name}:{uuid}`.
        lighthouse_addr: URL of the lighthouse.
        hostname: how peers reach this machine.
        bind: `host:port` to listen on (port 0 picks one).
        store_addr: `host:port` of this group's TCPStore.
        world_size: ranks in this replica group.
        heartbeat_interval: period of the lighthouse heartbeats; a lighthouse
            may advise a longer one on the stream (lighthouse.core.pacing), followed.
        connect_timeout: bound on reaching the lighthouse.
        quorum_retries: lighthouse quorum failures retried before the ranks see one.
        secret: the job's shared secret: required of our callers and sent to
            the lighthouse (lighthouse.rpc.auth); None: access control off.
        tls: serve TLS and reach the lighthouse over TLS (lighthouse.rpc.tls);
            `address()` is then https://. None: plaintext.
        local_collectives: the group's process group never talks to other
            groups (ProcessGroupDummy): it tells the lighthouse so, and
            lighthouse.core.compat lets it share a job with any torchft release.
        sched_batch: run the server's loop under SCHED_BATCH (the default,
            as ManagerConfig.control_sched), so that its wake-ups never
            preempt training (lighthouse.loop.set_batch_policy).

    Raises:
        ValueError: a bad option or bind address.
        OSError: the port is in use.
        LighthouseUnavailableError: the lighthouse cannot be reached.
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
        tls: TLSConfig | None = None,
        local_collectives: bool = False,
        sched_batch: bool = True,
        job_id: str | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be at least 1")
        self.replica_id = replica_id
        self._logger = GroupLog(logger, replica_id)
        self._lighthouse_addr = lighthouse_addr
        self._store_addr = store_addr
        self._world_size = world_size
        self._local_collectives = local_collectives
        self.session = LighthouseSession(
            replica_id,
            lighthouse_addr,
            heartbeat_interval,
            connect_timeout,
            quorum_retries,
            secret,
            tls,
            local_collectives,
            job_id,
        )
        """The group's calls to the lighthouse (opened on the loop by `_start`)."""
        self._secret = secret
        if tls is not None:
            tls.require_server("manager server")
        self._tls = tls
        self._checkpoint_metadata: dict[int, str] = {}
        self._gate = QuorumGate(
            replica_id, world_size, self._checkpoint_metadata, self._lighthouse_quorum
        )
        self._votes: dict[int, Round[bool]] = {}
        self._stopped = False
        host, port = parse_bind(bind)
        self._loop = BackgroundLoop(f"torchft_manager_server_{replica_id}", batch=sched_batch)
        try:
            self._port = self._loop.run(self._start(host, port))
        except BaseException:
            self._loop.stop()
            raise
        host_port = join_host_port(hostname or advertised_host(host), self._port)
        self._address = f"{scheme(tls)}://{host_port}"
        self._logger.info("manager server listening on %s (bind %s)", self._address, bind)
        warning = auth.exposure_warning(secret, host, "manager server")
        if warning:
            self._logger.warning("%s", warning)
        self._kill_refusals = auth.RefusalLog()

    async def _start(self, host: str, port: int) -> int:
        threads.take(threads.LOOP)
        self._server = serve.new_server(
            pb_grpc.add_ManagerServiceServicer_to_server,
            ManagerServicer(self),
            self._secret,
            "manager server",
        )
        bound = serve.bind(
            self._server, host, port, "set TORCHFT_MANAGER_PORT to a free port or 0", self._tls
        )
        await self.session.open()
        await self._server.start()
        return bound

    def address(self) -> str:
        return self._address

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._world_size

    def run(self, coro: Any, timeout_s: float) -> Any:
        """Runs `coro` on the server's loop and waits for it (in-process
        callers, LocalManagerClient).

        Raises:
            LoopStalledError: the loop did not finish it within `timeout_s`.
        """
        return self._loop.run(coro, timeout=timeout_s)

    def submit(self, coro: Any) -> Future[Any]:
        """Hands `coro` to the server's loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop.loop)

    # ---- quorum --------------------------------------------------------------

    async def quorum(self, request: QuorumRequest, timeout_s: float | None) -> QuorumResult:
        """Waits until every rank asked, then asks the lighthouse for the group.

        Raises:
            QuorumTimeoutError: no answer within `timeout_s`; the text names the
                ranks that did not ask, or carries the lighthouse's reason.
            ValueError: a field out of range (QuorumRequest.check).
            ValueError, QuorumError: a stray or forged call (admission.admit).
        """
        request.check(self._world_size)
        wait_s = MAX_WAIT_S if timeout_s is None else timeout_s
        rnd = self._gate.round
        future = self._gate.join(rnd, request, time.monotonic() + wait_s)  # or refuses it

        def stalled() -> QuorumTimeoutError:
            if rnd is self._gate.round:
                reason = rnd.stall_reason(self._world_size, "ask for a quorum", wait_s)
                return QuorumTimeoutError(
                    f"replica group {self.replica_id}: {reason}; is a rank of this group "
                    "stuck or dead?"
                )
            return QuorumTimeoutError(
                f"replica group {self.replica_id}: lighthouse {self._lighthouse_addr} gave no "
                f"answer within {wait_s:.1f} s"
            )

        try:
            result: QuorumResult = await wait_for_future(future, wait_s, stalled)
            return result
        finally:
            rnd.leave(request.group_rank, future)

    async def _lighthouse_quorum(self, rnd: Round[QuorumRequest]) -> None:
        group = merge_requests(
            rnd.calls,
            self.replica_id,
            self._address,
            self._store_addr,
            self._world_size,
            local_collectives=self._local_collectives,
        )
        deadline = min(rnd.deadlines.values(), default=time.monotonic() + MAX_WAIT_S)
        try:
            quorum, views = await self.session.ask(group.member, deadline, group.init_sync)
            members = quorum.participants
            self._gate.issued(views[0].max_step if views else max(m.step for m in members))
            result_of = self.session.take_in(quorum, views, group.init_sync)
        except Exception as e:
            for f in rnd.futures.values():
                if not f.done():
                    f.set_exception(e)
            return
        for rank, f in rnd.futures.items():
            if f.done():
                continue
            try:
                result = result_of(rank)
            except ValueError as e:
                f.set_exception(QuorumError(str(e)))
                continue
            if result.divergence:
                self._logger.error("DIVERGENCE: %s", result.divergence)
            f.set_result(result)

    def add_gone_listener(self, listener: GoneListener) -> None:
        """`listener(quorum_id, gone)` runs on this server's loop when the
        lighthouse says members of the group's latest quorum are gone
        (torchft_like.manager.gone_watch); it must return at once."""
        self.session.add_gone_listener(listener)

    # ---- commit vote -------------------------------------------------------

    async def should_commit(
        self, group_rank: int, step: int, vote: bool, timeout_s: float | None = None
    ) -> bool:
        """True for every rank only if every rank of the group voted True.

        Raises:
            QuorumTimeoutError: not every rank voted within `timeout_s`; names them.
            ValueError: a group rank outside the group.
        """
        self._check_rank(group_rank)
        wait_s = MAX_WAIT_S if timeout_s is None else timeout_s
        rnd = self._votes.setdefault(step, Round())
        future = rnd.join(group_rank, vote, time.monotonic() + wait_s)
        if not rnd.missing(self._world_size):
            del self._votes[step]
            decision = all(rnd.calls.values())
            if not decision:
                no = sorted(r for r, v in rnd.calls.items() if not v)
                self._logger.info("commit refused: group ranks %s voted no", no, step=step)
            for f in rnd.futures.values():
                if not f.done():
                    f.set_result(decision)

        def stalled() -> QuorumTimeoutError:
            reason = rnd.stall_reason(self._world_size, f"vote on step {step}", wait_s)
            return QuorumTimeoutError(f"replica group {self.replica_id}: {reason}")

        try:
            decided: bool = await wait_for_future(future, wait_s, stalled)
            return decided
        finally:
            rnd.leave(group_rank, future)
            # An abandoned vote must not leave its step behind: fuzzed or
            # stale steps would otherwise pile up for good.
            if not rnd.calls and self._votes.get(step) is rnd:
                del self._votes[step]

    def vote_alone(self, group_rank: int, step: int, vote: bool) -> bool:
        """should_commit of a group of one rank, on the caller's thread: the
        same checks and log line, no waiting (nobody else votes)."""
        self._check_rank(group_rank)
        if not vote:
            self._logger.info("commit refused: group ranks %s voted no", [group_rank], step=step)
        return vote

    def checkpoint_metadata(self, rank: int) -> str:
        """Raises NotServedError if group rank `rank` has not asked for a quorum yet."""
        metadata = self._checkpoint_metadata.get(rank)
        if metadata is None:
            raise NotServedError(
                f"group rank {rank} of {self.replica_id} has not asked for a quorum yet"
            )
        return metadata

    def kill(self, msg: str) -> None:
        """Ends this process (the whole group) shortly, once the caller is answered."""
        self._logger.error("killed by request: %s", msg)
        asyncio.get_running_loop().call_later(0.1, os._exit, 1)

    def remote_kill(self, msg: str, peer: str) -> None:
        """Kill asked over the network: obeyed only when the job has a secret
        (the interceptor has then checked it); without one anyone who can
        reach this port could end the group.

        Raises:
            PermissionError: no secret is configured.
        """
        if self._secret is None:
            why = (
                f"Kill refused: the manager server of {self.replica_id} has no shared secret, "
                "so it cannot tell who asks; start the job with TORCHFT_SECRET_FILE (or "
                "TORCHFT_SECRET) set and call Kill with the same secret"
            )
            self._kill_refusals.refused(peer, "a Kill", why)
            raise PermissionError(why)
        self.kill(msg)

    def _check_rank(self, group_rank: int) -> None:
        if not 0 <= group_rank < self._world_size:
            raise ValueError(f"group_rank ({group_rank}) must be in [0, {self._world_size})")

    def shutdown(self, leave: bool = True) -> None:
        """Stops serving; with `leave`, first tells the lighthouse we go on
        purpose so the other groups do not wait for our heartbeat to expire."""
        if self._stopped:
            return
        self._stopped = True
        self._loop.run(self._stop(leave), timeout=15)
        self._loop.stop()

    async def _stop(self, leave: bool) -> None:
        await self.session.close(leave)
        await self._server.stop(grace=None)
