"""One replica group's session with the lighthouse, held by its ManagerServer.

The session asks for the group's quorums (retrying an unreachable
lighthouse with backoff until the ranks' deadline), leaves out members our
process group cannot rendezvous with (lighthouse.core.compat), relays the
lighthouse's gone notices to the group's ranks, and heartbeats on one stream
at a pace a Quorum call postpones. Everything here runs on the server's loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

from lighthouse.client import AsyncLighthouseClient
from lighthouse.core.compat import refusals, training_members
from lighthouse.core.quorum import Quorum, QuorumMember
from lighthouse.core.views import QuorumResult, QuorumViews
from lighthouse.loop import reply_budget_s
from lighthouse.rpc.errors import (
    DuplicateGroupError,
    IncompatibleGroupError,
    LighthouseUnavailableError,
    QuorumError,
    QuorumTimeoutError,
)
from lighthouse.rpc.tls import TLSConfig
from torchft_like.manager.gone_watch import GroupNotices
from torchft_like.manager.group.log import GroupLog

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT = timedelta(milliseconds=300)
"""Bound of the Leave at shutdown, so that shutdown stays under a second."""
MAX_ADVISED_HEARTBEAT_S = 30.0
"""Longest lighthouse-advised heartbeat period followed (the lighthouse keeps
its advice under a third of its heartbeat timeout; this bounds a bad one)."""

GoneListener = Callable[[int, tuple[str, ...]], None]


def retry_delay_s(num_failures: int) -> float:
    """Backoff before the next lighthouse attempt: 0.1 s doubling to 1 s."""
    return min(1.0, 0.1 * 2**num_failures)


class LighthouseSession:
    """The group's calls to the lighthouse (arguments as ManagerServer's).

    Used on the server's loop: `open` once, then `ask` and `take_in` per
    quorum, `close` at shutdown.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        heartbeat_interval: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int,
        secret: str | None,
        tls: TLSConfig | None,
        local_collectives: bool,
        job_id: str | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.job_id = job_id
        self._logger = GroupLog(logger, replica_id)
        self.lighthouse_addr = lighthouse_addr
        self._heartbeat_interval = heartbeat_interval
        self._connect_timeout = connect_timeout
        self._quorum_retries = quorum_retries
        self._local_collectives = local_collectives
        self._secret = secret
        self._tls = tls
        self.client: AsyncLighthouseClient
        """The lighthouse's client, made by `open` on the loop (grpc.aio's channels need it)."""
        self._quorum_sent_at = -math.inf  # the last Quorum call's start (monotonic)
        self._heartbeat_due: tuple[asyncio.Future[None], float, asyncio.TimerHandle] | None = None
        """While the heartbeat loop waits out a Quorum call: its wake-up, period and timer."""
        self._prev_quorum_ids: tuple[str, ...] = ()
        """The members of the last quorum this group took part in (lighthouse.core.compat)."""
        self._notices = GroupNotices()
        """The latest quorum handed to our ranks, and gone notices about it."""
        self._gone_listeners: list[GoneListener] = []
        self._left_out_logged: set[str] = set()
        self._heartbeater: asyncio.Task[None] | None = None
        self._closed = False

    async def open(self) -> None:
        """One heartbeat, so that a lighthouse not there at all fails the
        start with its address; then the paced heartbeats begin.

        Raises:
            LighthouseUnavailableError: the lighthouse cannot be reached.
        """
        self.client = AsyncLighthouseClient(
            self.lighthouse_addr, self._connect_timeout, self._secret, self._tls, self.job_id
        )
        self.client.on_gone = self._on_gone
        await self.client.heartbeat(self.replica_id, self._connect_timeout)
        self._heartbeater = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    # ---- quorum --------------------------------------------------------------

    async def ask(
        self, member: QuorumMember, deadline: float, init_sync: bool
    ) -> tuple[Quorum, tuple[QuorumResult, ...]]:
        """The lighthouse's quorum for `member`, asked until `deadline`
        (monotonic), with the group's view: each group rank's share (our
        lighthouse; the quorum then comes without its members), or none (a
        lighthouse that answers with the members, pytorch/torchft's).

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
                answer = await self.client.quorum_view(
                    member, timedelta(seconds=remaining), init_sync
                )
            except LighthouseUnavailableError as e:
                if outage_start is None:
                    outage_start = time.monotonic()
                    self._logger.warning(
                        "lighthouse unreachable, retrying for up to %.1f s: %s", remaining, e
                    )
                # At most a heartbeat period: a restart costs itself and one period.
                cap_s = self._heartbeat_interval.total_seconds()
                delay = min(retry_delay_s(num_unreachable), cap_s)
                num_unreachable += 1
                if time.monotonic() + delay >= deadline:
                    raise LighthouseUnavailableError(
                        f"lighthouse {self.lighthouse_addr} unreachable until the quorum "
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
                self._logger.warning(
                    "lighthouse quorum failed (attempt %d of %d), retrying: %s",
                    attempt,
                    self._quorum_retries + 1,
                    e,
                )
                await asyncio.sleep(retry_delay_s(attempt - 1))
                continue
            if outage_start is not None:
                self._logger.info(
                    "lighthouse reachable again after %.1f s", time.monotonic() - outage_start
                )
            return answer

    def take_in(
        self, quorum: Quorum, views: tuple[QuorumResult, ...], init_sync: bool
    ) -> Callable[[int], QuorumResult]:
        """Each group rank's share of the quorum our ranks take in (a
        function of the group rank), and the gone notices heard about it
        before relayed now. A quorum that came with its members (from a
        lighthouse that does not answer views, pytorch/torchft's) is taken
        in less the members our process group cannot rendezvous with
        (lighthouse.core.compat: its nightly's members would stall our
        configure); ours never mixes them.

        Raises:
            IncompatibleGroupError: the rule keeps the other side; this
                group must stop so that they train on.
        """
        if views:
            members = None

            def result_of(group_rank: int) -> QuorumResult:
                return _view_of(views, group_rank=group_rank)

        else:
            if not self._local_collectives:
                quorum = self._compatible(quorum)
            members = quorum.replica_ids()
            shares, replica_id = QuorumViews(quorum), self.replica_id

            def result_of(group_rank: int) -> QuorumResult:
                return shares.result(replica_id, group_rank=group_rank, init_sync=init_sync)

        if not self._local_collectives:
            early = self._notices.applied(quorum.quorum_id, members)
            if early:  # heard before this quorum was taken in
                self._tell_gone(quorum.quorum_id, early)
        return result_of

    def _compatible(self, quorum: Quorum) -> Quorum:
        members = quorum.participants
        prev = self._prev_quorum_ids or training_members(members)
        refused = refusals({m.replica_id: m for m in members}, prev)
        if self.replica_id in refused:
            raise IncompatibleGroupError(refused[self.replica_id])
        if refused:
            if not refused.keys() <= self._left_out_logged:
                self._left_out_logged.update(refused)
                self._logger.warning(
                    "leaving out of quorum %d: %s",
                    quorum.quorum_id,
                    "; ".join(refused.values()),
                )
            kept = tuple(m for m in quorum.participants if m.replica_id not in refused)
            quorum = replace(quorum, participants=kept)
        self._prev_quorum_ids = quorum.replica_ids()
        return quorum

    # ---- gone notices --------------------------------------------------------

    def add_gone_listener(self, listener: GoneListener) -> None:
        """`listener(quorum_id, gone)` runs on the server's loop when the
        lighthouse says members of the group's latest quorum are gone
        (torchft_like.manager.gone_watch); it must return at once."""
        self._gone_listeners.append(listener)

    def _on_gone(self, quorum_id: int, gone: tuple[str, ...]) -> None:
        ours = self._notices.heard(quorum_id, gone)
        if ours:
            self._tell_gone(quorum_id, ours)

    def _tell_gone(self, quorum_id: int, gone: tuple[str, ...]) -> None:
        for listener in self._gone_listeners:
            listener(quorum_id, gone)

    # ---- heartbeats ----------------------------------------------------------

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
        while not self._closed:
            since_quorum = time.monotonic() - self._quorum_sent_at
            stream_down = use_stream and not self.client.heartbeat_stream_open()
            if since_quorum < period and not stream_down:
                await self._quiet_for(period - since_quorum, period)
                continue
            try:
                if use_stream and not await self.client.stream_heartbeat(self.replica_id, timeout):
                    use_stream = False
                    self._logger.info("the lighthouse has no HeartbeatStream; unary heartbeats")
                if not use_stream:
                    await self.client.heartbeat(self.replica_id, timeout)
                if failing:
                    self._logger.info("lighthouse heartbeats succeed again")
                failing = False
            except DuplicateGroupError as e:
                # The quorum calls fail with it too, and the Manager stops there.
                if not failing:
                    self._logger.error("refused by the lighthouse: %s", e)
                failing = True
            except Exception as e:
                if not failing:
                    self._logger.warning("lighthouse heartbeat failed, will keep trying: %s", e)
                failing = True
            advised = self.client.advised_interval() if use_stream else None
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
        if self._heartbeat_due is None or not self.client.heartbeat_stream_open():
            return
        due, period_s, timer = self._heartbeat_due
        timer.cancel()
        self._heartbeat_due = (
            due,
            period_s,
            asyncio.get_running_loop().call_later(period_s, _settle, due),
        )

    async def close(self, leave: bool) -> None:
        """Ends the heartbeats; with `leave`, tells the lighthouse we go on
        purpose so the other groups do not wait out our heartbeat timeout."""
        self._closed = True
        # Heartbeats end first: one that reached the lighthouse after our Leave
        # would make us healthy again, and the others wait out its timeout.
        # Closing the stream first also fails a write in flight, which a
        # cancelled task alone may keep waiting on.
        self.client.close_heartbeat_stream()
        if self._heartbeater is not None:
            self._heartbeater.cancel()
            # On Python < 3.12 asyncio.wait_for can swallow a cancel that races
            # its result; the loop then ends at its next check of _closed.
            await asyncio.wait([self._heartbeater], timeout=1.0)
        if leave:
            # Best effort and short: a stopped lighthouse (the normal order at
            # the end of a job) must not hold shutdown up.
            try:
                await self.client.leave(self.replica_id, LEAVE_TIMEOUT)
            except Exception as e:
                self._logger.info("could not tell the lighthouse we leave: %s", e)
        await self.client.close()


def _view_of(views: tuple[QuorumResult, ...], group_rank: int) -> QuorumResult:
    if not 0 <= group_rank < len(views):
        raise ValueError(f"the lighthouse's view has {len(views)} group ranks, not {group_rank}")
    return views[group_rank]


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
