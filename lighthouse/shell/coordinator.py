"""The shell around the membership state machine (lighthouse.core.membership):
the clock, each waiting call under its ticket, the heartbeat streams, the
metrics and the status page's memory, all on the server's one loop. It
turns each RPC into an event and acts on the effects: answers calls (each
issued quorum serialized once, or each caller's view of it,
lighthouse.core.views), logs, and tells gone members' peers on their streams.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from lighthouse import wire
from lighthouse.core.effects import (
    AdviceChanged,
    DecideSoon,
    Effect,
    Fail,
    Handed,
    Issued,
    JudgeGoneSoon,
    Log,
    Outcome,
    Placed,
)
from lighthouse.core.gone import Gone
from lighthouse.core.jobs import DEFAULT_JOB, member_refusal, total_refusal
from lighthouse.core.membership import Membership
from lighthouse.core.quorum import LighthouseConfig, Quorum, QuorumMember
from lighthouse.core.views import QuorumViews
from lighthouse.rpc import errors
from lighthouse.rpc.call import Call
from lighthouse.rpc.errors import JobLimitError, QuorumTimeoutError
from lighthouse.rpc.h2 import corking
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.shell.metrics import JobMetrics
from lighthouse.shell.parked import Deadlines, Parked
from lighthouse.shell.state_file import StateFile
from lighthouse.status.view import StatusView

logger = logging.getLogger("lighthouse.shell.server")

COST_FACTOR = 10
"""Paced work waits for 10x its previous run's cost (Paced)."""
ANSWER_SLICE = 512
"""Callers of one issued quorum answered per loop turn (Coordinator._answer):
~5 ms of work at most."""


class Paced:
    """Work of O(replicas) asked for by each of many events (a decision, a
    round of gone notices): run once for all that arrive meanwhile, no
    sooner than 10x its last run's cost after that run, which keeps it
    under ~10% of the loop however many events a step brings. `clock`
    reads the seconds costs are measured in."""

    def __init__(
        self, run: Callable[[], None], clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._run = run
        self._clock = clock
        self._handle: asyncio.Handle | None = None
        self._running = False
        self._ended_at = 0.0
        """`clock` seconds when the last run ended."""
        self._cost_s = 0.0

    def due(self) -> bool:
        """Whether a run now would keep the pace."""
        return self._clock() >= self._ended_at + COST_FACTOR * self._cost_s

    def soon(self) -> None:
        """Runs in this turn of the loop, or once the pace allows."""
        if self._handle is not None or self._running:
            return
        loop = asyncio.get_running_loop()
        wait = self._ended_at + COST_FACTOR * self._cost_s - self._clock()
        if wait > 0:
            self._handle = loop.call_later(wait, self._fire)
        else:
            self._handle = loop.call_soon(self._fire)

    def cancel(self) -> None:
        """Drops the run asked for: the caller runs the work itself now."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def ran(self, cost_s: float) -> None:
        """A run (by `soon` or by the caller) ended now, having cost `cost_s`."""
        self._ended_at = self._clock()
        self._cost_s = cost_s

    def _fire(self) -> None:
        self._handle, self._running = None, True
        try:
            self._run()
        finally:
            self._running = False


class Outbox(Protocol):
    """Where a HeartbeatPaced stream's advice and gone notices go: its call
    (lighthouse.rpc.call), which writes each at once."""

    def write(self, message: pb.LighthouseHeartbeatAdvice, /) -> bool: ...


class ReplicaCount:
    """The replicas every job of a lighthouse knows, against `cap`: counted
    up as each new one is admitted, and recounted exactly by the jobs'
    sweep (lighthouse.shell.jobs), which sees those forgotten."""

    __slots__ = ("cap", "total")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.total = 0

    def take(self) -> bool:
        if self.total >= self.cap:
            return False
        self.total += 1
        return True


class JobLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The server's logger, each line naming the job it is about."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"job {self.extra['job']}: {msg}", kwargs  # type: ignore[index]


class Coordinator:
    """One job's shell around lighthouse.core.membership: the clock, the
    waiting calls, the metrics and the status page's memory, all on one loop
    (lighthouse.shell.jobs holds one per job).

    With `collect_after_issue`, the collector's young generations run in the
    turn after a quorum's answers went out (lighthouse.cli.tune_gc: the
    standalone process, whose thresholds then keep them out of a step's burst).
    """

    def __init__(
        self,
        config: LighthouseConfig,
        metrics: JobMetrics,
        state: StateFile | None,
        collect_after_issue: bool = False,
        job: str = DEFAULT_JOB,
        max_members: int = 20_000,
        replicas: ReplicaCount | None = None,
    ) -> None:
        self.job = job
        self.replicas = replicas if replicas is not None else ReplicaCount(max_members)
        self.log = JobLog(logger, {"job": job})
        self.max_members = max_members
        self.collect_after_issue = collect_after_issue
        self.metrics = metrics
        self.state = state
        restored = state.restored if state is not None else None
        self.membership = Membership(config, time.monotonic(), restored)
        self.view = StatusView(self.membership)
        self.parked: dict[int, Parked] = {}
        """ticket -> a Quorum call waiting for its quorum (Coordinator.park)."""
        self.deadlines = Deadlines(self._overdue)
        self._response: tuple[Quorum | None, bytes] = (None, b"")
        self._views: QuorumViews | None = None
        self.outboxes: dict[str, set[Outbox]] = {}
        """replica_id -> the outboxes of its HeartbeatPaced streams (gone notices)."""
        self._deciding = Paced(self._decide_now)
        self._gone: dict[int, Gone] = {}
        """quorum id -> its latest gone notice, not yet told (tell_gone_soon)."""
        self._telling = Paced(self._tell_gone)
        metrics.heartbeat_advice.set(self.membership.advice_ms / 1000)

    def apply(self, outcome: Outcome, now: float) -> None:
        """Acts on an event's effects; raises the calling RPC's refusal."""
        if outcome.effects:
            wall = time.time()
            for effect in outcome.effects:
                self._act(effect)
            self.view.observe(outcome.effects, now, wall)
            if any(isinstance(e, Issued) for e in outcome.effects):
                goodput = self.view.progress.job_goodput()
                if goodput is not None:
                    self.metrics.goodput.set(goodput)
            if any(isinstance(e, DecideSoon) and e.now for e in outcome.effects):
                # Every replica waits: decide in this turn of the loop, so the
                # last caller's answer is ready when its handler goes on; a
                # job of thousands (its decision takes ms) in a turn of its
                # own, after the reads already waiting, other jobs' included.
                if len(self.membership.participants) <= ANSWER_SLICE:
                    self._decide_now()
                else:
                    asyncio.get_running_loop().call_soon(self._decide_now)
        if outcome.error is not None:
            raise outcome.error

    def _act(self, effect: Effect) -> None:
        if isinstance(effect, Issued):
            self._issued(effect)
        elif isinstance(effect, Fail):
            self.end(effect.ticket, effect.error)
        elif isinstance(effect, Placed):
            waiting = self.parked.pop(effect.ticket, None)
            if waiting is not None:  # the membership let it go as it placed it
                if waiting.slot >= 0:
                    self.deadlines.remove(waiting.slot, effect.ticket)
                waiting.call.answer(pb.TakeReplicaGroupResponse(replica_group=effect.group))
            self.metrics.spares_waiting.set(self.membership.num_spares_waiting())
        elif isinstance(effect, Handed):
            if effect.promotion:
                self.metrics.spare_promotions.inc()
            self.log.info(
                "%s %s trains as replica group %s%s",
                "spare" if effect.promotion else "process",
                effect.spare_id,
                effect.group,
                " (its replicas died)" if effect.promotion else "",
            )
        elif isinstance(effect, Log):
            self.log.log(effect.level, effect.msg, *effect.args)
        elif isinstance(effect, DecideSoon) and not effect.now:
            self.decide_soon()
        elif isinstance(effect, AdviceChanged):
            self.metrics.heartbeat_advice.set(effect.advice_ms / 1000)
        elif isinstance(effect, Gone):
            self._gone[effect.notice.quorum_id] = effect
            self.tell_gone_soon()
        elif isinstance(effect, JudgeGoneSoon):
            self.tell_gone_soon()

    def _issued(self, issued: Issued) -> None:
        quorum = issued.quorum
        self.metrics.on_quorum(quorum)
        # A new quorum is news, and so is the end of a logged stall; the
        # same members again (every step) is not.
        level = logging.INFO if issued.news else logging.DEBUG
        if self.log.isEnabledFor(level):  # the member list costs O(members) to format
            self.log.log(
                level,
                "quorum %d issued (%s): %s",
                quorum.quorum_id,
                issued.reason,
                ", ".join(f"{m.replica_id} step={m.step}" for m in quorum.participants),
            )
        if self.state is not None:  # before any caller hears of it (lighthouse.shell.state_file)
            self.state.issued(time.monotonic(), quorum, self.membership.high_water_step)
        self._answer(issued.tickets, quorum)
        if self.collect_after_issue:
            asyncio.get_running_loop().call_soon(gc.collect, 1)

    def _answer(self, tickets: tuple[int, ...], quorum: Quorum, start: int = 0) -> None:
        """Answers the callers of an issued quorum, ANSWER_SLICE a loop turn:
        the other jobs' calls get the loop between slices, so a job of
        thousands delays another's quorum by a slice, not by all its answers."""
        end = start + ANSWER_SLICE
        if end < len(tickets):
            asyncio.get_running_loop().call_soon(self._answer, tickets, quorum, end)
        now = time.monotonic()
        parked, observe = self.parked, self.metrics.quorum_latency.observe
        with corking.corked():  # the slice goes out in one tight loop, a send per connection
            for ticket in tickets[start:end]:
                waiting = parked.pop(ticket, None)
                if waiting is not None:
                    if waiting.slot >= 0:
                        self.deadlines.remove(waiting.slot, ticket)
                    waiting.call.answer(self.quorum_response(quorum, waiting.viewer))
                    observe(now - waiting.since)

    def admit(self, replica_id: str) -> None:
        """Raises JobLimitError for a replica new to a job that holds its most."""
        known = self.membership.heartbeats
        if replica_id in known:
            return
        if len(known) >= self.max_members:
            raise JobLimitError(member_refusal(self.job, replica_id, len(known), self.max_members))
        if not self.replicas.take():
            raise JobLimitError(total_refusal(replica_id, self.replicas.total, self.replicas.cap))

    def busy(self) -> bool:
        """Whether anyone is in the job: a replica known, a call waiting, a
        stream open (lighthouse.core.jobs.idle_jobs)."""
        m = self.membership
        return bool(m.heartbeats or m.open_streams or self.parked or self.outboxes)

    def heartbeat(self, replica_id: str) -> None:
        """Raises DuplicateGroupError for a second live replica of one group,
        JobLimitError for one past the job's bound."""
        self.admit(replica_id)
        now = time.monotonic()
        self.apply(self.membership.heartbeat(now, replica_id), now)
        self.metrics.heartbeats.inc()

    def park(
        self,
        member: QuorumMember,
        call: Call,
        viewer: wire.Viewer | None,
        budget_s: float | None,
    ) -> Parked | None:
        """Registers a Quorum call that waits parked: `call` gets its
        serialized answer (`viewer`'s view, if it asked) in the turn that
        issues a quorum containing `member`, or its error, at the latest
        when `budget_s` (None: no deadline) is up. Returns its record while
        it waits (None: answered in this turn); `call` withdraws it if it
        ends otherwise."""
        self.admit(member.replica_id)
        now = time.monotonic()
        outcome = self.membership.join(now, member)
        parked = None
        if outcome.error is None:
            parked = Parked(call, member.replica_id, outcome.ticket, viewer, now, budget_s)
            self.parked[outcome.ticket] = parked
        self.apply(outcome, now)  # may answer it already
        if parked is None:
            return None
        return self._keep(parked)

    def timeout_error(self, replica_id: str, budget_s: float) -> Exception:
        """What a Quorum call whose deadline came first is told: what was missing."""
        membership = self.membership
        error = errors.FreshStartRefusedError if membership.refused_fresh_start else None
        return (error or QuorumTimeoutError)(
            f"no quorum containing {replica_id} within {budget_s:.1f} s: {membership.reason}"
        )

    def _overdue(self, ticket: int) -> None:
        call = self.parked.get(ticket)
        if call is not None and call.budget_s is not None:
            call.slot = -1
            self.end(ticket, self.timeout_error(call.replica_id, call.budget_s))

    def end(self, ticket: int, error: Exception) -> None:
        """Ends a waiting call: a Quorum call fails with `error`; a spare is
        answered "no group yet" (it asks again: a spare outlives deadlines
        and lighthouse restarts)."""
        waiting = self.parked.pop(ticket, None)
        if waiting is None:
            return
        if waiting.slot >= 0:
            self.deadlines.remove(waiting.slot, ticket)
        if waiting.spare:
            self.membership.spare_ends(ticket)
            self.metrics.spares_waiting.set(self.membership.num_spares_waiting())
            waiting.call.answer(pb.TakeReplicaGroupResponse(replica_group=""))
            return
        self.membership.withdraw(waiting.replica_id, ticket)
        waiting.call.fail(error)

    def quorum_response(self, quorum: Quorum, viewer: wire.Viewer | None = None) -> bytes:
        """`viewer`'s view of `quorum` when it asked for one (O(its group
        ranks)), else every member: converted and serialized once per
        quorum, so every such call returns the same bytes (decode_guard
        passes bytes through), where doing either per call is O(members^2)
        a step."""
        if viewer is not None:
            if self._views is None or self._views.quorum is not quorum:
                self._views = QuorumViews(quorum)
            return wire.view_response(self._views, *viewer)
        if self._response[0] is not quorum:
            response = pb.LighthouseQuorumResponse(quorum=wire.quorum_to_proto(quorum))
            self._response = (quorum, response.SerializeToString())
        return self._response[1]

    def withdraw(self, replica_id: str, ticket: int) -> None:
        """A waiting call ended otherwise (its caller went away)."""
        waiting = self.parked.pop(ticket, None)
        if waiting is not None and waiting.slot >= 0:
            self.deadlines.remove(waiting.slot, ticket)
        if waiting is not None and waiting.spare:
            self.membership.spare_ends(ticket)
            self.metrics.spares_waiting.set(self.membership.num_spares_waiting())
            return
        self.membership.withdraw(replica_id, ticket)

    def leave(self, replica_id: str) -> None:
        now = time.monotonic()
        self.apply(self.membership.leave(now, time.time(), replica_id), now)

    def stream_opened(self, replica_id: str, outbox: Outbox | None) -> None:
        """A heartbeat stream opened; `outbox` (HeartbeatPaced) gets its notices."""
        self.membership.stream_opened(replica_id)
        if outbox is not None:
            self.outboxes.setdefault(replica_id, set()).add(outbox)

    def stream_ended(self, replica_id: str, outbox: Outbox | None) -> None:
        boxes = self.outboxes.get(replica_id)
        if boxes is not None and outbox is not None:
            boxes.discard(outbox)
            if not boxes:
                del self.outboxes[replica_id]
        now = time.monotonic()
        self.apply(self.membership.stream_ended(now, replica_id), now)

    def park_spare(
        self, spare_id: str, wanted: str, call: Call, budget_s: float | None
    ) -> Parked | None:
        """Registers a TakeReplicaGroup call that waits parked, beside the
        Quorum calls: `call` gets the group to train as once there is one,
        or "" (ask again) when `budget_s` (None: no deadline) is up. Returns
        its record while it waits (None: answered in this turn); `call`
        withdraws it if it ends otherwise."""
        now = time.monotonic()
        outcome = self.membership.spare_waits(now, spare_id, wanted)
        if outcome.error is not None:
            raise outcome.error
        parked = Parked(call, spare_id, outcome.ticket, None, now, budget_s, spare=True)
        self.parked[outcome.ticket] = parked
        self.metrics.spares_waiting.set(self.membership.num_spares_waiting())
        self.apply(outcome, now)  # may place it already
        return self._keep(parked)

    def _keep(self, parked: Parked) -> Parked | None:
        """A call registered and not answered in its own turn waits: under
        its deadline, and withdrawn if its caller goes away."""
        if self.parked.get(parked.ticket) is not parked:
            return None
        if parked.budget_s is not None:
            parked.slot = self.deadlines.add(parked.ticket, parked.budget_s)
        rid, ticket = parked.replica_id, parked.ticket
        parked.call.park(lambda: self.withdraw(rid, ticket))
        return parked

    def decide_soon(self) -> None:
        """Decides once for all the calls that arrive meanwhile: a decision
        costs O(replicas), so deciding per call is O(replicas^2) a step
        (Paced: 20 us with 2 replicas, ~10 ms with a thousand)."""
        self._deciding.soon()

    def tell_gone_soon(self) -> None:
        """Judges the closed streams and tells the gone notices once for
        all the deaths that come meanwhile: a notice names every member
        gone so far to every live one, so when N streams end together (a
        job's end, a switch failure), judging and telling each death at
        once costs O(N^2); the latest notice of a quorum says all its
        predecessors said."""
        self._telling.soon()

    def _tell_gone(self) -> None:
        start = time.perf_counter()
        now = time.monotonic()
        self.apply(self.membership.judge_gone(now), now)  # its notices join _gone
        pending, self._gone = self._gone, {}
        for effect in pending.values():
            notice = effect.notice
            message = pb.LighthouseHeartbeatAdvice(
                interval_ms=self.membership.advice_ms,
                gone=pb.LighthouseGoneNotice(quorum_id=notice.quorum_id, replica_ids=notice.gone),
            )
            for rid in notice.recipients:
                for outbox in self.outboxes.get(rid, ()):
                    outbox.write(message)
        self._telling.ran(time.perf_counter() - start)

    def _decide_now(self) -> None:
        self._deciding.cancel()
        if self.membership.participants:
            start = time.perf_counter()
            now = time.monotonic()
            outcome = self.membership.decide(now, time.time())
            cost_s = time.perf_counter() - start  # answers sent are not its cost
            self.apply(outcome, now)
            self._deciding.ran(cost_s)

    def tick(self) -> None:
        """The periodic event; its decision waits like decide_soon's, so
        that decisions (O(replicas)) take at most ~10% of the loop."""
        start = time.perf_counter()
        now = time.monotonic()
        decide = bool(self.membership.participants) and self._deciding.due()
        outcome = self.membership.tick(now, time.time(), decide)
        if decide:
            self._deciding.ran(time.perf_counter() - start)
        self.apply(outcome, now)
        if self.state is not None:
            self.state.flush(now)
        self.metrics.healthy_replicas.set(self.membership.num_healthy(now))

    def snapshot(self) -> dict[str, Any]:
        return {"job": self.job, **self.view.snapshot(time.monotonic(), time.time())}

    def summary(self, now: float, wall: float, protected: bool) -> dict[str, Any]:
        """The job's line on the status page's list; of a job with a secret
        of its own, only its name (its page needs the secret)."""
        if protected:
            return {"job": self.job, "protected": True}
        m = self.membership
        quorum = m.prev_quorum
        return {
            "job": self.job,
            "protected": False,
            "members": len(m.heartbeats),
            "healthy": m.num_healthy(now),
            "step": m.high_water_step,
            "quorum_id": quorum.quorum_id if quorum else None,
            "quorum_age_s": round(wall - quorum.created, 3) if quorum else None,
            "last_failure": self.view.last_failure(),
        }

    def close(self) -> None:
        """The job is forgotten: its timers go (it has no call waiting)."""
        self._deciding.cancel()
        self._telling.cancel()
        self.deadlines.close()
