"""The per-group ManagerServer (hosted by group rank 0) and its in-process client.

The server gathers one Quorum call from every rank of the group, asks the
lighthouse once for the whole group (torchft_like.group_quorum), and answers
each rank with its own view (torchft_like.recovery). It also collects the
group's commit votes. It runs on a private asyncio loop, so waiting never
holds the GIL.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from datetime import timedelta
from typing import Any

from lighthouse.client import AsyncLighthouseClient
from lighthouse.compat import refusals, training_members
from lighthouse.quorum import Quorum, QuorumMember
from lighthouse.rpc import auth, serve
from lighthouse.rpc.address import advertised_host, join_host_port, parse_bind
from lighthouse.rpc.errors import (
    DuplicateGroupError,
    IncompatibleGroupError,
    LighthouseUnavailableError,
    NotServedError,
    QuorumError,
    QuorumTimeoutError,
)
from lighthouse.rpc.loop import BackgroundLoop, reply_budget_s, wait_for_future
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig, scheme
from torchft_like._quorum_gate import QuorumGate
from torchft_like._round import Round
from torchft_like.gone_watch import GroupNotices
from torchft_like.group_quorum import QuorumRequest, merge_requests
from torchft_like.manager_client import ManagerClient
from torchft_like.manager_servicer import ManagerServicer
from torchft_like.recovery import QuorumResult, compute_quorum_result

__all__ = ["ManagerClient", "ManagerServer"]

logger = logging.getLogger(__name__)

MAX_WAIT_S = 24 * 3600.0
"""Bound of a call that came without a deadline."""

LEAVE_TIMEOUT = timedelta(milliseconds=300)
"""Bound of the Leave at shutdown, so that shutdown stays under a second."""
MAX_ADVISED_HEARTBEAT_S = 30.0
"""Longest lighthouse-advised heartbeat period followed (the lighthouse keeps
its advice under a third of its heartbeat timeout; this bounds a bad one)."""


def retry_delay_s(num_failures: int) -> float:
    """Backoff before the next lighthouse attempt: 0.1 s doubling to 1 s."""
    return min(1.0, 0.1 * 2**num_failures)


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
            may advise a longer one on the stream (lighthouse.pacing), followed.
        connect_timeout: bound on reaching the lighthouse.
        quorum_retries: lighthouse quorum failures retried before the ranks see one.
        secret: the job's shared secret: required of our callers and sent to
            the lighthouse (lighthouse.rpc.auth); None: access control off.
        tls: serve TLS and reach the lighthouse over TLS (lighthouse.rpc.tls);
            `address()` is then https://. None: plaintext.
        local_collectives: the group's process group never talks to other
            groups (ProcessGroupDummy): it tells the lighthouse so, and
            lighthouse.compat lets it share a job with any torchft release.
        sched_batch: run the server's loop under SCHED_BATCH (the default,
            as ManagerConfig.control_sched), so that its wake-ups never
            preempt training (lighthouse.rpc.loop.set_batch_policy).

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
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be at least 1")
        self.replica_id = replica_id
        self._lighthouse_addr = lighthouse_addr
        self._store_addr = store_addr
        self._world_size = world_size
        self._heartbeat_interval = heartbeat_interval
        self._quorum_sent_at = -math.inf  # the last Quorum call's start (monotonic)
        self._heartbeat_due: tuple[asyncio.Future[None], float, asyncio.TimerHandle] | None = None
        """While the heartbeat loop waits out a Quorum call: its wake-up, period and timer."""
        self._connect_timeout = connect_timeout
        self._quorum_retries = quorum_retries
        self._local_collectives = local_collectives
        self._prev_quorum_ids: tuple[str, ...] = ()
        """The members of the last quorum this group took part in (lighthouse.compat)."""
        self._notices = GroupNotices()
        """The latest quorum handed to our ranks, and gone notices about it."""
        self._gone_listeners: list[Callable[[int, tuple[str, ...]], None]] = []
        self._left_out_logged: set[str] = set()
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
        self._loop = BackgroundLoop(f"manager-server-{replica_id}", batch=sched_batch)
        try:
            self._port = self._loop.run(self._start(host, port))
        except BaseException:
            self._loop.stop()
            raise
        host_port = join_host_port(hostname or advertised_host(host), self._port)
        self._address = f"{scheme(tls)}://{host_port}"
        logger.info("[%s] manager server listening on %s (bind %s)", replica_id, self._address,
                    bind)  # fmt: skip
        warning = auth.exposure_warning(secret, host, "manager server")
        if warning:
            logger.warning("[%s] %s", replica_id, warning)
        self._kill_refusals = auth.RefusalLog()

    async def _start(self, host: str, port: int) -> int:
        self._lighthouse = AsyncLighthouseClient(
            self._lighthouse_addr, self._connect_timeout, self._secret, self._tls
        )
        self._lighthouse.on_gone = self._on_gone
        self._server = serve.new_server(
            pb_grpc.add_ManagerServiceServicer_to_server,
            ManagerServicer(self),
            self._secret,
            "manager server",
        )
        bound = serve.bind(
            self._server, host, port, "set TORCHFT_MANAGER_PORT to a free port or 0", self._tls
        )
        # Fail fast with the address when the lighthouse is not there at all.
        await self._lighthouse.heartbeat(self.replica_id, self._connect_timeout)
        await self._server.start()
        self._heartbeater = asyncio.get_running_loop().create_task(self._heartbeat_loop())
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
            ValueError, QuorumError: a stray or forged call (quorum_admission).
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
            quorum = await self._quorum_with_retries(group.member, deadline)
            self._gate.issued(quorum)
            if not self._local_collectives:
                quorum = self._compatible_members(quorum)
                early = self._notices.applied(quorum.quorum_id, quorum.replica_ids())
                if early:  # heard before this quorum was taken in
                    self._tell_gone(quorum.quorum_id, early)
        except Exception as e:
            for f in rnd.futures.values():
                if not f.done():
                    f.set_exception(e)
            return
        for rank, f in rnd.futures.items():
            if f.done():
                continue
            try:
                result = compute_quorum_result(quorum, self.replica_id, rank, group.init_sync)
            except ValueError as e:
                f.set_exception(QuorumError(str(e)))
                continue
            if result.divergence:
                logger.error("[%s] DIVERGENCE: %s", self.replica_id, result.divergence)
            f.set_result(result)

    def _compatible_members(self, quorum: Quorum) -> Quorum:
        """The quorum less the members our process group cannot rendezvous
        with (lighthouse.compat). Our lighthouse never mixes them; torchft's
        does, and its nightly's members would stall our configure.

        Raises:
            IncompatibleGroupError: the rule keeps the other side; this
                group must stop so that they train on.
        """
        members = quorum.participants
        prev = self._prev_quorum_ids or training_members(members)
        refused = refusals({m.replica_id: m for m in members}, prev)
        if self.replica_id in refused:
            raise IncompatibleGroupError(refused[self.replica_id])
        if refused:
            if not refused.keys() <= self._left_out_logged:
                self._left_out_logged.update(refused)
                logger.warning(
                    "[%s] leaving out of quorum %d: %s",
                    self.replica_id,
                    quorum.quorum_id,
                    "; ".join(refused.values()),
                )
            kept = tuple(m for m in quorum.participants if m.replica_id not in refused)
            quorum = replace(quorum, participants=kept)
        self._prev_quorum_ids = quorum.replica_ids()
        return quorum

    async def _quorum_with_retries(self, member: QuorumMember, deadline: float) -> Quorum:
        """Asks the lighthouse until `deadline` (monotonic).

        An unreachable lighthouse (restarting, a network blip) is retried with
        backoff until the deadline, so the group waits out the outage and goes
        on when it is back instead of failing one step per attempt. Other
        failures are retried `quorum_retries` times; a timeout is not retried
        and keeps the lighthouse's reason.
        """
        attempt = 0
        outage_start: float | None = None
        num_unreachable = 0
        while True:
            # Before the ranks' own deadline, so they get the lighthouse's reason.
            remaining = reply_budget_s(deadline - time.monotonic()) or 0.001
            try:
                self._quorum_sent_at = time.monotonic()
                self._postpone_heartbeat()
                quorum = await self._lighthouse.quorum(member, timedelta(seconds=remaining))
            except LighthouseUnavailableError as e:
                if outage_start is None:
                    outage_start = time.monotonic()
                    logger.warning(
                        "[%s] lighthouse unreachable, retrying for up to %.1f s: %s",
                        self.replica_id,
                        remaining,
                        e,
                    )
                # At most a heartbeat period: a restart costs itself and one period.
                cap_s = self._heartbeat_interval.total_seconds()
                delay = min(retry_delay_s(num_unreachable), cap_s)
                num_unreachable += 1
                if time.monotonic() + delay >= deadline:
                    raise LighthouseUnavailableError(
                        f"lighthouse {self._lighthouse_addr} unreachable until the quorum "
                        f"deadline: {e}"
                    ) from None
                await asyncio.sleep(delay)
                continue
            except (QuorumTimeoutError, DuplicateGroupError, IncompatibleGroupError):
                raise  # a retry cannot help: keep the lighthouse's reason
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

    def add_gone_listener(self, listener: Callable[[int, tuple[str, ...]], None]) -> None:
        """`listener(quorum_id, gone)` runs on this server's loop when the
        lighthouse says members of the group's latest quorum are gone
        (torchft_like.gone_watch); it must return at once."""
        self._gone_listeners.append(listener)

    def _on_gone(self, quorum_id: int, gone: tuple[str, ...]) -> None:
        ours = self._notices.heard(quorum_id, gone)
        if ours:
            self._tell_gone(quorum_id, ours)

    def _tell_gone(self, quorum_id: int, gone: tuple[str, ...]) -> None:
        for listener in self._gone_listeners:
            listener(quorum_id, gone)

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
                logger.info(
                    "[%s step=%d] commit refused: group ranks %s voted no",
                    self.replica_id,
                    step,
                    no,
                )
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
            logger.info(
                "[%s step=%d] commit refused: group ranks %s voted no",
                self.replica_id,
                step,
                [group_rank],
            )
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
        logger.error("[%s] killed by request: %s", self.replica_id, msg)
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

    # ---- background ----------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Heartbeats on one stream (its closing tells the lighthouse at once
        that we died), at the longer of our period and the one the lighthouse
        advises on it; unary calls to a lighthouse without a heartbeat stream.
        None within a period of a Quorum call, which both lighthouses count as
        one (a heartbeat costs us about as much CPU as the step's quorum),
        while the stream is open: a closed one is opened again at once."""
        failing = False
        use_stream = True
        interval = period = self._heartbeat_interval.total_seconds()
        timeout = timedelta(seconds=max(1.0, 10 * interval))
        while not self._stopped:
            since_quorum = time.monotonic() - self._quorum_sent_at
            stream_down = use_stream and not self._lighthouse.heartbeat_stream_open()
            if since_quorum < period and not stream_down:
                await self._quiet_for(period - since_quorum, period)
                continue
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
            except DuplicateGroupError as e:
                # The quorum calls fail with it too, and the Manager stops there.
                if not failing:
                    logger.error("[%s] refused by the lighthouse: %s", self.replica_id, e)
                failing = True
            except Exception as e:
                if not failing:
                    logger.warning(
                        "[%s] lighthouse heartbeat failed, will keep trying: %s", self.replica_id, e
                    )
                failing = True
            advised = self._lighthouse.advised_interval() if use_stream else None
            period = interval
            if advised is not None:
                period = max(interval, min(advised.total_seconds(), MAX_ADVISED_HEARTBEAT_S))
            await asyncio.sleep(period)

    async def _quiet_for(self, delay_s: float, period_s: float) -> None:
        """Sleeps `delay_s`, or longer while Quorum calls keep postponing the
        wake-up (`_postpone_heartbeat`): a group stepping faster than its
        period does not wake for nothing each step (~0.3 ms of CPU here)."""
        loop = asyncio.get_running_loop()
        due: asyncio.Future[None] = loop.create_future()
        self._heartbeat_due = (due, period_s, loop.call_later(delay_s, _settle, due))
        try:
            await due
        finally:
            self._heartbeat_due[2].cancel()
            self._heartbeat_due = None

    def _postpone_heartbeat(self) -> None:
        """A Quorum call counts as a heartbeat: the next one is a period away.
        Not while the stream is down, whose reopening is due at once."""
        if self._heartbeat_due is None or not self._lighthouse.heartbeat_stream_open():
            return
        due, period_s, timer = self._heartbeat_due
        timer.cancel()
        self._heartbeat_due = (
            due,
            period_s,
            asyncio.get_running_loop().call_later(period_s, _settle, due),
        )

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
            # Best effort and short: a stopped lighthouse (the normal order at
            # the end of a job) must not hold shutdown up; the others then
            # wait out our heartbeat timeout instead.
            try:
                await self._lighthouse.leave(self.replica_id, LEAVE_TIMEOUT)
            except Exception as e:
                logger.info("[%s] could not tell the lighthouse we leave: %s", self.replica_id, e)
        await self._server.stop(grace=None)
        await self._lighthouse.close()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
