"""The lighthouse's membership as a state machine: events in, effects out.

Who is known, healthy, waiting for a quorum or waiting as a spare, and what
follows from each event: a heartbeat, a Quorum call (join), a Leave, a
heartbeat stream opened or ended, a tick, a spare asking for a group. Each
event takes the time (`now`, monotonic seconds; `wall`, epoch seconds where
an issued quorum needs it) and returns an `Outcome`: the calling RPC's
refusal, if any, and the effects the server acts on (quorums to deliver,
calls to fail, spares to answer, lines worth logging, a decision to run
soon). The server owns the futures, the clock, the metrics and the
transport; the status page (lighthouse.status.view) observes the effects.

Pure: no futures, no clock reads, no metrics, no asyncio. The quorum itself
is lighthouse.core.quorum's `compute_quorum`; spare placement is
lighthouse.core.spares' `assign_groups`. Tested as a table (tests/unit/test_membership.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from lighthouse.core.effects import (
    AdviceChanged,
    DecideSoon,
    Effect,
    Fail,
    Forgotten,
    Handed,
    Issued,
    Joined,
    JudgeGoneSoon,
    Log,
    Outcome,
    Placed,
    TwinRefused,
)
from lighthouse.core.gone import Gone, GoneWatch
from lighthouse.core.history import why_absent
from lighthouse.core.lateness import Lateness
from lighthouse.core.pacing import advised_interval_ms, suspect_floor_ms
from lighthouse.core.quorum import (
    ArrivalStats,
    JobMark,
    LighthouseConfig,
    LighthouseState,
    Participant,
    Quorum,
    QuorumMember,
    compute_quorum,
    group_name,
    healthy_replicas,
    next_quorum_id,
    quorum_changed,
    record_arrival,
    twin_refusal,
)
from lighthouse.core.quorum_log import waiting_report
from lighthouse.core.spares import SpareRequest, assign_groups
from lighthouse.rpc.errors import (
    DuplicateGroupError,
    FreshStartRefusedError,
    IncompatibleGroupError,
    QuorumError,
)

MAX_REFUSALS_LOGGED = 10_000
"""Refused replicas remembered so each is logged once (bounds memory under churn)."""
FRESH_START_HOLD_S = 3.0
"""A call held by quorum.fresh_start_refusal gets the reason after this long,
so the group's log says why it waits now, not at its deadline (it asks again)."""


NOTHING = Outcome()
_DECIDE_SOON, _DECIDE_NOW = DecideSoon(), DecideSoon(now=True)
_JUDGE_GONE_SOON = JudgeGoneSoon()


class Membership:
    """The lighthouse's state: replicas known, waiting calls, spares.

    Args:
        config: the quorum rule's options.
        started_at: monotonic seconds when the lighthouse started (see
            compute_quorum's restart grace).
        restored: what the state file kept from before a restart (the
            high-water mark, the last quorum's id and members), or None.
    """

    def __init__(
        self, config: LighthouseConfig, started_at: float, restored: JobMark | None = None
    ) -> None:
        self.config = config
        self.started_at = started_at
        self.heartbeats: dict[str, float] = {}
        """replica_id -> monotonic seconds of its last heartbeat or Quorum call."""
        self.arrivals: dict[str, ArrivalStats] = {}
        """replica_id -> its heartbeat rhythm (quorum.suspected_replicas)."""
        self.open_streams: dict[str, int] = {}
        """replica_id -> heartbeat streams open (a reconnect may overlap the old one)."""
        self.streams_closed: dict[str, float] = {}
        """replica_id -> when its last open heartbeat stream ended without a Leave."""
        self.by_name: dict[str, set[str]] = {}
        """Group name -> known replica ids of that name (see twin_refusal)."""
        self.described: dict[str, QuorumMember] = {}
        """Last self-description of each replica (its last Quorum call)."""
        self.participants: dict[str, Participant] = {}
        """Replicas waiting in a Quorum call."""
        self.tickets: dict[str, int] = {}
        """replica_id -> the ticket of its waiting call."""
        self.spares: list[tuple[int, SpareRequest]] = []
        """Waiting TakeReplicaGroup calls (ticket, request), oldest first."""
        self.held: dict[str, tuple[str, float]] = {}
        """spare_id -> (group it was handed, when), so each of its ranks gets the same."""
        self.reserved: dict[str, float] = {}
        """group -> when it was handed out, until a replica of it is live."""
        self.prev_quorum: Quorum | None = None
        self.quorum_id = 0
        self.high_water_step = 0
        """The highest step of any issued quorum's member (quorum.fresh_start_refusal)."""
        self.held_state: set[str] = set()
        """Replicas that asked at a step past 0 (quorum.fresh_start_refusal)."""
        if restored is not None:
            self.high_water_step, self.quorum_id = restored.high_water_step, restored.quorum_id
            self.prev_quorum = restored.quorum()
        self.restored = self.prev_quorum is not None
        """prev_quorum came from the state file; no quorum issued since."""
        self.departed: dict[str, str] = {}
        """Members of the last quorum dropped since (Leave, forgotten) -> why."""
        self.gone = GoneWatch()
        """The latest quorum's members judged gone, and who was told."""
        self.reason = "no replica has asked for a quorum yet"
        """The latest decision's reason (a timed-out caller hears it)."""
        self.refused_fresh_start = False
        """The latest decision was quorum.fresh_start_refusal's veto."""
        self.summary = self.reason
        """The status page's line: the last issued quorum's reason, a calm
        count mid-step, or the reason of a stall (lighthouse.core.quorum_log)."""
        self._logged_status: tuple[str, int] | None = None
        self._refusals_logged: set[str] = set()
        self._next_ticket = 0
        self.advice_ms = 0
        """The heartbeat period advised on HeartbeatPaced streams (lighthouse.core.pacing)."""
        self.decide_config = config
        """`config` with the suspicion floor raised to the advice (see _repace)."""
        self.late: set[str] = set()
        """Replicas silent past `_late_after_s` (found by `_silence`, not a scan)."""
        self.closed: set[str] = set()
        """Replicas whose heartbeat stream closed since their last heartbeat."""
        self.timed_out: set[str] = set()
        """Replicas silent past the heartbeat timeout (by `_timing_out`; see num_healthy)."""
        self._silence = Lateness()
        self._timing_out = Lateness()
        self._forgetting = Lateness()
        self._spares_due = float("inf")
        """When a spare may take a group no event frees: a reservation ends."""
        self._repace([])

    # -- queries ----------------------------------------------------------

    def healthy(self, now: float) -> set[str]:
        return healthy_replicas(
            now, self.heartbeats, self.config.heartbeat_timeout_ms, self.streams_closed
        )

    def num_healthy(self, now: float) -> int:
        """len(healthy(now)), from the timed out and closed replicas alone:
        no Python loop over them (after a mass death every tick counts)."""
        timeout_s = self.config.heartbeat_timeout_ms / 1000
        self.timed_out.update(self._timing_out.expired(now, self.heartbeats, timeout_s))
        return len(self.heartbeats) - len(self.timed_out) - len(self.closed - self.timed_out)

    def _everyone_waits(self, now: float) -> bool:
        """Whether every healthy replica (and min_replicas) waits in a Quorum
        call, so a decision can be made now. (num_healthy counts a suspected
        one as healthy, so this never holds before that.) Counted only when
        the callers reach the least the healthy can be: in a burst of N
        calls, N - 1 are answered by lengths alone."""
        waiting = len(self.participants)
        if waiting < self.config.min_replicas:
            return False
        if waiting < len(self.heartbeats) - len(self.late) - len(self.closed):
            return False  # the unhealthy are among the late and the closed
        return waiting >= self.num_healthy(now)

    def num_spares_waiting(self) -> int:
        """Spare processes waiting (a spare's ranks count once)."""
        return len({request.spare_id for _, request in self.spares})

    # -- events -----------------------------------------------------------

    def heartbeat(self, now: float, replica_id: str) -> Outcome:
        """A heartbeat; refused with DuplicateGroupError for a second live
        replica of one group."""
        refusal = self._admit(now, replica_id)
        if refusal is not None:
            return refusal
        self._heard(now, replica_id)
        notice = self.gone.heard_from(replica_id)
        return Outcome((Gone(notice),)) if notice is not None else NOTHING

    def join(self, now: float, member: QuorumMember) -> Outcome:
        """A Quorum call: the caller waits under the returned ticket for the
        first issued quorum that contains `member` (an `Issued` naming the
        ticket), and must `withdraw` it when its call ends."""
        rid = member.replica_id
        refusal = self._admit(now, rid)
        if refusal is not None:
            return refusal
        self._heard(now, rid)
        self.described[rid] = member
        if member.step > 0:
            self.held_state.add(rid)
        effects: list[Effect] = [Joined(member)]
        old = self.tickets.get(rid)
        if old is not None:
            superseded = f"replica {rid} called Quorum again; this call is superseded"
            effects.append(Fail(old, QuorumError(superseded)))
        self._next_ticket += 1
        self.participants[rid] = Participant(member, now)
        self.tickets[rid] = self._next_ticket
        effects.append(_DECIDE_NOW if self._everyone_waits(now) else _DECIDE_SOON)
        return Outcome(tuple(effects), ticket=self._next_ticket)

    def withdraw(self, replica_id: str, ticket: int) -> None:
        """A call that ended (answered, cancelled or past its deadline) must
        not be put into a quorum it will never hear of."""
        if self.tickets.get(replica_id) == ticket:
            del self.tickets[replica_id]
            del self.participants[replica_id]

    def leave(self, now: float, wall: float, replica_id: str) -> Outcome:
        """Forgets a replica that stops on purpose, and re-decides at once."""
        effects: list[Effect] = [Log(logging.INFO, "replica %s left", (replica_id,))]
        effects += self._forget(replica_id, "left on purpose (Leave)")
        effects += self._judge_gone(now)
        ticket = self.tickets.pop(replica_id, None)
        if ticket is not None:
            del self.participants[replica_id]
            effects.append(Fail(ticket, QuorumError(f"replica {replica_id} left")))
        if self.participants:
            effects += self.decide(now, wall).effects
        return Outcome(tuple(effects))

    def stream_opened(self, replica_id: str) -> None:
        self.open_streams[replica_id] = self.open_streams.get(replica_id, 0) + 1

    def stream_ended(self, now: float, replica_id: str) -> Outcome:
        """A heartbeat stream ended. Its last one ending without a Leave (the
        replica is still known) is taken as the replica being gone, now."""
        left = self.open_streams.get(replica_id, 1) - 1
        if left > 0:
            self.open_streams[replica_id] = left
            return NOTHING
        self.open_streams.pop(replica_id, None)
        if replica_id not in self.heartbeats:
            return NOTHING
        # A replica that stops on purpose closes its stream just before its
        # Leave (no heartbeat may follow a Leave), so this is not yet a death.
        effects: list[Effect] = [
            Log(
                logging.INFO,
                "replica %s: heartbeat stream closed; unhealthy until it heartbeats again "
                "(a 'left' line follows if it stopped on purpose)",
                (replica_id,),
            )
        ]
        self.streams_closed[replica_id] = now
        self.closed.add(replica_id)
        effects.append(_JUDGE_GONE_SOON)
        effects += self.place_spares(now).effects  # a death frees its name for a spare, now
        if self.participants:
            effects.append(_DECIDE_SOON)
        return Outcome(tuple(effects))

    def tick(self, now: float, wall: float, decide: bool = True) -> Outcome:
        """The periodic event: forgets long-silent replicas, re-paces, judges
        the late, re-decides for waiting calls (unless not `decide`: the
        server paces decisions by their cost) and places spares. It looks
        only at replicas whose silence deadline passed (lighthouse.core.lateness):
        O(1) when nothing changed, however many replicas there are."""
        effects: list[Effect] = []
        forget_s = self.config.forget_after_s
        forgotten = self._forgetting.expired(now, self.heartbeats, forget_s)
        for rid in forgotten:
            if rid in self.participants:  # a waiting call: looked at again in a second
                self._forgetting.heard(rid, now + 1.0 - forget_s, forget_s)
                continue
            line = "forgetting replica %s: silent for over %.0f s"
            effects.append(Log(logging.INFO, line, (rid, forget_s)))
            effects += self._forget(rid, f"forgotten: silent over {forget_s:.0f} s")
        self._repace(effects)
        newly_late = self._silence.expired(now, self.heartbeats, self._late_after_s())
        self.late.update(newly_late)
        if self.late or self.closed or self.departed:
            effects += self._judge_gone(now)
        if self.participants and decide:
            effects += self.decide(now, wall).effects
        if self.spares and (newly_late or forgotten or now >= self._spares_due):
            effects += self.place_spares(now).effects  # silent past the timeout: free now
        return Outcome(tuple(effects))

    def decide(self, now: float, wall: float) -> Outcome:
        """Runs the quorum rule for the waiting calls."""
        state = LighthouseState(
            self.participants,
            self.heartbeats,
            self.prev_quorum,
            streams_closed=self.streams_closed,
            started_at=self.started_at,
            arrivals=self.arrivals,
            described=self.described,
            high_water_step=self.high_water_step,
            held_state=self.held_state,
            restored=self.restored,
        )
        decision = compute_quorum(now, state, self.decide_config)
        self.reason, self.refused_fresh_start = decision.reason, decision.kind == "fresh_start"
        effects: list[Effect] = []
        for rid, why in decision.refused.items():
            self._refuse(rid, why, effects)
        if decision.members is None:
            self._report_waiting(now, decision.kind, decision.reason, effects)
            if decision.kind == "fresh_start":
                self._answer_held(now, FreshStartRefusedError(decision.reason), effects)
            return Outcome(tuple(effects))
        after_stall, self._logged_status = self._logged_status is not None, None
        self.summary = f"quorum issued: {decision.reason}"
        # After a gone notice the id changes even with the same members
        # (one came back): a notice must never name a later quorum's collectives.
        changed = quorum_changed(self.prev_quorum, decision.members) or self.gone.any_gone()
        if changed:
            self.quorum_id = next_quorum_id(self.quorum_id, int(wall * 1000))
        quorum = Quorum(self.quorum_id, decision.members, wall)
        prev_ids = self.prev_quorum.replica_ids() if self.prev_quorum else ()
        absent: dict[str, str] = {}
        if changed:
            in_quorum = set(quorum.replica_ids())
            absent = {
                rid: why_absent(
                    now,
                    rid,
                    self.heartbeats,
                    self.streams_closed,
                    self.arrivals,
                    self.config,
                    self.departed,
                )
                for rid in prev_ids
                if rid not in in_quorum
            }
            self.departed.clear()
        self.prev_quorum = quorum
        self.gone.issued(quorum.quorum_id, quorum.replica_ids())
        self.restored = False
        self.high_water_step = max(self.high_water_step, *(m.step for m in quorum.participants))
        tickets = []
        for member in quorum.participants:
            del self.participants[member.replica_id]
            tickets.append(self.tickets.pop(member.replica_id))
        # Callers left out join again: their join timeout starts over.
        for rid, participant in self.participants.items():
            self.participants[rid] = replace(participant, joined_at=now)
        effects.append(
            Issued(
                quorum,
                tuple(tickets),
                changed,
                news=changed or after_stall,
                reason=decision.reason,
                prev_ids=prev_ids,
                absent=absent,
            )
        )
        return Outcome(tuple(effects))

    def spare_waits(self, now: float, spare_id: str, wanted: str) -> Outcome:
        """A TakeReplicaGroup call: it waits under the returned ticket for a
        `Placed` naming it, and must be ended with `spare_ends`."""
        if not spare_id:
            return Outcome(error=ValueError("spare_id must be a non-empty string"))
        self._next_ticket += 1
        ticket = self._next_ticket
        self.spares.append((ticket, SpareRequest(spare_id, wanted, now)))
        return replace(self.place_spares(now), ticket=ticket)

    def spare_ends(self, ticket: int) -> None:
        """A TakeReplicaGroup call ended (answered, cancelled or past its deadline)."""
        self.spares = [(t, request) for t, request in self.spares if t != ticket]

    def place_spares(self, now: float) -> Outcome:
        """Answers every waiting spare that can take a group now (lighthouse.core.spares)."""
        remember_s = self.config.forget_after_s
        for sid in [sid for sid, (_, at) in self.held.items() if now - at >= remember_s]:
            del self.held[sid]
        if not self.spares:
            return NOTHING
        placed = assign_groups(
            now,
            [request for _, request in self.spares],
            self.by_name.keys(),
            {group_name(rid) for rid in self.healthy(now)},
            {sid: group for sid, (group, _) in self.held.items()},
            self.reserved,
            reserve_s=max(5.0, 2 * self.config.heartbeat_timeout_ms / 1000),
        )
        effects: list[Effect] = []
        waiting = []
        reserve_s = max(5.0, 2 * self.config.heartbeat_timeout_ms / 1000)
        self._spares_due = min(self.reserved.values(), default=float("inf")) + reserve_s
        for ticket, request in self.spares:
            group = placed.get(request.spare_id)
            if group is None:
                waiting.append((ticket, request))
                continue
            if request.spare_id not in self.held:
                self.held[request.spare_id] = (group, now)
                self.reserved[group] = now
                effects.append(Handed(request.spare_id, group, request.wanted))
            effects.append(Placed(ticket, group))
        self.spares = waiting
        return Outcome(tuple(effects))

    # -- internals --------------------------------------------------------

    def _repace(self, effects: list[Effect]) -> None:
        """Recomputes the advised heartbeat period from the replicas known
        (on each tick: a stream hears of a change with its next heartbeat)."""
        advice = advised_interval_ms(len(self.heartbeats), self.config.heartbeat_timeout_ms)
        if advice == self.advice_ms:
            return
        self.advice_ms = advice
        floor = suspect_floor_ms(self.config.suspect_min_ms, advice)
        self.decide_config = replace(self.config, suspect_min_ms=floor)
        effects.append(AdviceChanged(advice))

    def _late_after_s(self) -> float:
        """The least silence that matters: suspicion's floor, or the timeout."""
        after_s = self.config.heartbeat_timeout_ms / 1000
        if self.decide_config.suspect_phi > 0:
            after_s = min(after_s, self.decide_config.suspect_min_ms / 1000)
        return after_s

    def judge_gone(self, now: float) -> Outcome:
        """Judges the late, closed and departed (after JudgeGoneSoon)."""
        return Outcome(tuple(self._judge_gone(now)))

    def _judge_gone(self, now: float) -> list[Effect]:
        """Tells the latest quorum's live members of members newly judged
        gone. Only the late, closed and departed can be: the others were
        heard within the least silence that matters, on an open stream."""
        candidates = self.late | self.closed | self.departed.keys()
        args = (self.heartbeats, self.streams_closed, self.arrivals, self.decide_config)
        notice = self.gone.judge(now, candidates, *args)
        if notice is None:
            return []
        return [Log(logging.INFO, "%s", (self.gone.describe(notice),)), Gone(notice)]

    def _heard(self, now: float, replica_id: str) -> None:
        last = self.heartbeats.get(replica_id)
        if last is not None:
            cap_s = self.config.heartbeat_timeout_ms / 1000
            self.arrivals[replica_id] = record_arrival(
                self.arrivals.get(replica_id), now - last, cap_s
            )
        self.heartbeats[replica_id] = now
        self.late.discard(replica_id)
        self.closed.discard(replica_id)
        self.timed_out.discard(replica_id)
        self._silence.heard(replica_id, now, self._late_after_s())
        self._timing_out.heard(replica_id, now, self.config.heartbeat_timeout_ms / 1000)
        self._forgetting.heard(replica_id, now, self.config.forget_after_s)

    def _admit(self, now: float, replica_id: str) -> Outcome | None:
        """Refuses a replica whose group name another live replica holds
        (twin_refusal); a refused replica leaves no trace, so the live one
        keeps the name until it dies or leaves."""
        name = group_name(replica_id)
        known = self.by_name.get(name)
        if known is not None and len(known) == 1 and replica_id in known:
            self.reserved.pop(name, None)
            return None  # the name's one replica: no twin (every heartbeat and call)
        reason = twin_refusal(
            now,
            replica_id,
            known or (),
            self.heartbeats,
            self.config.heartbeat_timeout_ms,
            self.streams_closed,
        )
        if reason is not None:
            effects: tuple[Effect, ...] = ()
            # Once per refused replica: its heartbeats may keep coming 10 times a second.
            if self._first_refusal(replica_id):
                effects = (
                    Log(logging.WARNING, "refused: %s", (reason,)),
                    TwinRefused(replica_id, reason),
                )
            return Outcome(effects, error=DuplicateGroupError(reason))
        self.by_name.setdefault(name, set()).add(replica_id)
        self.reserved.pop(name, None)  # whoever it was handed to is here
        return None

    def _first_refusal(self, replica_id: str) -> bool:
        if replica_id in self._refusals_logged or len(self._refusals_logged) >= MAX_REFUSALS_LOGGED:
            return False
        self._refusals_logged.add(replica_id)
        return True

    def _refuse(self, replica_id: str, why: str, effects: list[Effect]) -> None:
        """Answers a waiting replica of another rendezvous with the reason (logged once)."""
        ticket = self.tickets.pop(replica_id, None)
        if ticket is None:
            return
        del self.participants[replica_id]
        if self._first_refusal(replica_id):
            effects.append(Log(logging.WARNING, "refusing %s: %s", (replica_id, why)))
        effects.append(Fail(ticket, IncompatibleGroupError(why)))

    def _answer_held(self, now: float, error: QuorumError, effects: list[Effect]) -> None:
        """Fails the calls waiting FRESH_START_HOLD_S or longer with `error`."""
        for rid, participant in list(self.participants.items()):
            if now - participant.joined_at >= FRESH_START_HOLD_S:
                del self.participants[rid]
                effects.append(Fail(self.tickets.pop(rid), error))

    def _forget(self, replica_id: str, why: str) -> Sequence[Effect]:
        name = group_name(replica_id)
        same = self.by_name.get(name)
        if same is not None:
            same.discard(replica_id)
            if not same:
                del self.by_name[name]
        self._refusals_logged.discard(replica_id)
        self.heartbeats.pop(replica_id, None)
        self.arrivals.pop(replica_id, None)
        self.described.pop(replica_id, None)
        self.held_state.discard(replica_id)
        self.streams_closed.pop(replica_id, None)
        self.late.discard(replica_id)
        self.closed.discard(replica_id)
        self.timed_out.discard(replica_id)
        if self.prev_quorum is not None and replica_id in self.prev_quorum.replica_ids():
            self.departed[replica_id] = why
        return (Forgotten(replica_id, why),)

    def _report_waiting(self, now: float, kind: str, reason: str, effects: list[Effect]) -> None:
        """Mid-step waits at DEBUG; a stall at INFO, one line per change of
        its reason's kind or of the healthy count: not one per tick, nor one
        per joining replica (a thousand replicas joining is one line)."""
        if not self.participants:
            return  # every waiting call was refused (lighthouse.core.compat)
        healthy = self.healthy(now)
        first_joined_at = min(p.joined_at for p in self.participants.values())
        num_joined = sum(1 for rid in self.participants if rid in healthy)
        report = waiting_report(now, first_joined_at, num_joined, len(healthy), reason)
        # A refused fresh start is news at once: no wait makes it go away.
        refused = kind == "fresh_start"
        self.summary = reason if refused else report.summary
        if not report.stalled and not refused:
            effects.append(Log(logging.DEBUG, "quorum status: %s", (reason,)))
            return
        key = (kind, len(healthy))
        if key != self._logged_status:
            self._logged_status = key
            level = logging.WARNING if refused else logging.INFO
            effects.append(Log(level, "quorum status: %s", (self.summary,)))
