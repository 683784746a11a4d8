"""The lighthouse server: gRPC service, waiting callers and the tick loop.

All state lives on one asyncio loop (no locks). Each Quorum call registers a
waiter; the decision (lighthouse.quorum) runs at once and on every tick, and
an issued quorum answers every waiter it contains.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import grpc
from grpc import aio

from lighthouse import wire
from lighthouse.heals import HEAL_KEY, HealEvent, apply_report, heals_in_quorum, report_of
from lighthouse.history import HISTORY_LENGTH, HistoryEntry, quorum_entry, why_absent
from lighthouse.metrics import LighthouseMetrics
from lighthouse.pacing import advised_interval_ms, suspect_floor_ms
from lighthouse.progress import RATE_WINDOW_S, Progress, step_rate
from lighthouse.quorum import (
    ArrivalStats,
    LighthouseConfig,
    LighthouseState,
    Participant,
    Quorum,
    QuorumMember,
    compute_quorum,
    forgotten_replicas,
    group_name,
    healthy_replicas,
    next_quorum_id,
    quorum_changed,
    record_arrival,
    twin_refusal,
)
from lighthouse.quorum_log import waiting_report
from lighthouse.rpc import auth, channel, errors, serve
from lighthouse.rpc.address import advertised_host, join_host_port, parse_bind
from lighthouse.rpc.errors import (
    DuplicateGroupError,
    IncompatibleGroupError,
    QuorumError,
    QuorumTimeoutError,
)
from lighthouse.rpc.loop import BackgroundLoop, reply_budget_s, wait_within
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig, scheme
from lighthouse.spares import SpareRequest, assign_groups
from lighthouse.status import StatusServer

logger = logging.getLogger(__name__)

HEALS_KEPT = 50
"""Heal events the status page keeps (newest first)."""
KILL_TIMEOUT_S = 5.0
MAX_NAMES_KEPT = 100_000
DECIDE_COST_FACTOR = 10
"""A call-triggered decision waits for 10x the previous one's cost (see decide_soon)."""


@dataclass
class _Waiter:
    participant: Participant
    future: asyncio.Future[Quorum]


@dataclass
class _SpareWaiter:
    request: SpareRequest
    future: asyncio.Future[str]


class _Coordinator:
    """The lighthouse's state and the actions taken on each decision."""

    def __init__(self, config: LighthouseConfig, metrics: LighthouseMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.waiters: dict[str, _Waiter] = {}
        self.heartbeats: dict[str, float] = {}
        self.arrivals: dict[str, ArrivalStats] = {}
        """replica_id -> its heartbeat rhythm (quorum.suspected_replicas)."""
        self.open_streams: dict[str, int] = {}
        """replica_id -> heartbeat streams open (a reconnect may overlap the old one)."""
        self.streams_closed: dict[str, float] = {}
        """replica_id -> when its last open heartbeat stream ended without a Leave."""
        self.by_name: dict[str, set[str]] = {}
        """Group name -> known replica ids of that name (see twin_refusal)."""
        self._refusals_logged: set[str] = set()
        self.members: dict[str, QuorumMember] = {}
        """Last known self-description of each replica, for the status page."""
        self.prev_quorum: Quorum | None = None
        self.started_at = time.monotonic()
        self.quorum_id = 0
        self.reason = "no replica has asked for a quorum yet"
        """The latest decision's reason (a timed-out caller hears it)."""
        self.summary = self.reason
        """The status page's line: the last issued quorum's reason, a calm
        count mid-step, or the reason of a stall (lighthouse.quorum_log)."""
        self._logged_status: tuple[str, int] | None = None
        self.spares: list[_SpareWaiter] = []
        """Waiting TakeReplicaGroup calls, oldest first (lighthouse.spares)."""
        self.held: dict[str, tuple[str, float]] = {}
        """spare_id -> (group it was handed, when), so each of its ranks gets the same."""
        self.reserved: dict[str, float] = {}
        """group -> when it was handed out, until a replica of it is live."""
        self._decide_soon = False
        self._decided_at = 0.0
        """perf_counter seconds when the last call-triggered decision ended."""
        self._decide_cost_s = 0.0
        """How long that decision took."""
        # The status page's memory, each bounded (lighthouse.history, .heals, .progress).
        self.history: deque[HistoryEntry] = deque(maxlen=HISTORY_LENGTH)
        self.heals: list[HealEvent] = []
        self.progress = Progress()
        self.ever_in_quorum: set[str] = set()
        self.names_in_quorum: set[str] = set()
        """Group names seen in a quorum (at most MAX_NAMES_KEPT), to tell a restart."""
        self.departed: dict[str, str] = {}
        """Members of the last quorum dropped since (Leave, forgotten) -> why."""
        self.advice_ms = 0
        """The heartbeat period advised on HeartbeatPaced streams (lighthouse.pacing)."""
        self.decide_config = config
        """`config` with the suspicion floor raised to the advice (see repace)."""
        self.repace()

    def repace(self) -> None:
        """Recomputes the advised heartbeat period from the replicas known
        (on each tick: a stream hears of a change with its next heartbeat)."""
        advice = advised_interval_ms(len(self.heartbeats), self.config.heartbeat_timeout_ms)
        if advice == self.advice_ms:
            return
        self.advice_ms = advice
        self.metrics.heartbeat_advice.set(advice / 1000)
        floor = suspect_floor_ms(self.config.suspect_min_ms, advice)
        self.decide_config = replace(self.config, suspect_min_ms=floor)

    def heartbeat(self, replica_id: str) -> None:
        """Raises DuplicateGroupError for a second live replica of one group."""
        now = time.monotonic()
        self._admit(replica_id, now)
        self._heard(replica_id, now)
        self.metrics.heartbeats.inc()

    def _heard(self, replica_id: str, now: float) -> None:
        last = self.heartbeats.get(replica_id)
        if last is not None:
            cap_s = self.config.heartbeat_timeout_ms / 1000
            self.arrivals[replica_id] = record_arrival(
                self.arrivals.get(replica_id), now - last, cap_s
            )
        self.heartbeats[replica_id] = now

    def _admit(self, replica_id: str, now: float) -> None:
        """Refuses a replica whose group name another live replica holds
        (twin_refusal); a refused replica leaves no trace, so the live one
        keeps the name until it dies or leaves."""
        name = group_name(replica_id)
        reason = twin_refusal(
            now,
            replica_id,
            self.by_name.get(name, ()),
            self.heartbeats,
            self.config.heartbeat_timeout_ms,
            self.streams_closed,
        )
        if reason is not None:
            # Once per refused replica: its heartbeats may keep coming 10 times a second.
            if replica_id not in self._refusals_logged and len(self._refusals_logged) < 10_000:
                self._refusals_logged.add(replica_id)
                logger.warning("refused: %s", reason)
                self.history.appendleft(
                    HistoryEntry(time.time(), None, note=f"twin refused: {reason.split(';')[0]}")
                )
            raise DuplicateGroupError(reason)
        self.by_name.setdefault(name, set()).add(replica_id)
        self.reserved.pop(name, None)  # whoever it was handed to is here

    def stream_opened(self, replica_id: str) -> None:
        self.open_streams[replica_id] = self.open_streams.get(replica_id, 0) + 1

    def stream_ended(self, replica_id: str) -> None:
        """A heartbeat stream ended. Its last one ending without a Leave (the
        replica is still known) is taken as the replica being gone, now."""
        left = self.open_streams.get(replica_id, 1) - 1
        if left > 0:
            self.open_streams[replica_id] = left
            return
        self.open_streams.pop(replica_id, None)
        if replica_id not in self.heartbeats:
            return
        # A replica that stops on purpose closes its stream just before its
        # Leave (no heartbeat may follow a Leave), so this is not yet a death.
        logger.info(
            "replica %s: heartbeat stream closed; unhealthy until it heartbeats again "
            "(a 'left' line follows if it stopped on purpose)",
            replica_id,
        )
        self.streams_closed[replica_id] = time.monotonic()
        self.place_spares()  # a death frees its group's name for a spare, now
        if self.waiters:
            self.decide_soon()

    def _forget(self, replica_id: str) -> None:
        name = group_name(replica_id)
        same = self.by_name.get(name)
        if same is not None:
            same.discard(replica_id)
            if not same:
                del self.by_name[name]
        self._refusals_logged.discard(replica_id)
        self.ever_in_quorum.discard(replica_id)
        self.heartbeats.pop(replica_id, None)
        self.arrivals.pop(replica_id, None)
        self.members.pop(replica_id, None)
        self.streams_closed.pop(replica_id, None)

    def leave(self, replica_id: str) -> None:
        """Forgets a replica that stops on purpose, and re-decides at once."""
        logger.info("replica %s left", replica_id)
        self._forget(replica_id)
        self._departed(replica_id, "left on purpose (Leave)")
        waiter = self.waiters.pop(replica_id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_exception(QuorumError(f"replica {replica_id} left"))
        if self.waiters:
            self.decide()

    def join(self, member: QuorumMember) -> _Waiter:
        """Registers a Quorum call; its future gets the first issued quorum
        that contains `member`. The caller must `withdraw` it when done."""
        now = time.monotonic()
        self._admit(member.replica_id, now)
        self._heard(member.replica_id, now)
        self.members[member.replica_id] = member
        self._observe(member, now)
        old = self.waiters.pop(member.replica_id, None)
        if old is not None and not old.future.done():
            old.future.set_exception(
                QuorumError(
                    f"replica {member.replica_id} called Quorum again; this call is superseded"
                )
            )
        waiter = _Waiter(Participant(member, now), asyncio.get_running_loop().create_future())
        self.waiters[member.replica_id] = waiter
        self.decide_soon()
        return waiter

    def withdraw(self, waiter: _Waiter) -> None:
        """A call that ended (answered, cancelled or past its deadline) must
        not be put into a quorum it will never hear of."""
        replica_id = waiter.participant.member.replica_id
        if self.waiters.get(replica_id) is waiter:
            del self.waiters[replica_id]

    def _departed(self, replica_id: str, why: str) -> None:
        if self.prev_quorum is not None and replica_id in self.prev_quorum.replica_ids():
            self.departed[replica_id] = why

    def _observe(self, member: QuorumMember, now: float) -> None:
        """Records the step of a Quorum call and any heal report it carries."""
        wall = time.time()
        self.progress.observe(group_name(member.replica_id), member.step, wall, now)
        if isinstance(member.data, str) and HEAL_KEY not in member.data:
            return  # the usual case: no JSON to parse
        report = report_of(member)
        if report is not None:
            by_address = {m.address: rid for rid, m in self.members.items() if m.address}
            if apply_report(self.heals, member.replica_id, report, wall, by_address):
                del self.heals[HEALS_KEPT:]

    def _record_quorum(self, quorum: Quorum, changed: bool, reason: str, now: float) -> None:
        """The status page's side of an issued quorum: history, heals, progress."""
        self.progress.on_quorum(len(quorum.participants))
        goodput = self.progress.job_goodput()
        if goodput is not None:
            self.metrics.goodput.set(goodput)
        ids = quorum.replica_ids()
        if changed:
            prev = self.prev_quorum.replica_ids() if self.prev_quorum else ()
            in_quorum = set(ids)
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
                for rid in prev
                if rid not in in_quorum
            }
            self.history.appendleft(
                quorum_entry(
                    quorum.created,
                    quorum.quorum_id,
                    prev,
                    ids,
                    reason,
                    absent,
                    self.ever_in_quorum,
                    self.names_in_quorum,
                )
            )
            self.departed.clear()
            self.ever_in_quorum.update(ids)
            if len(self.names_in_quorum) < MAX_NAMES_KEPT:
                self.names_in_quorum.update(group_name(rid) for rid in ids)
        seen = {(h.replica_id, h.step) for h in self.heals}
        for event in heals_in_quorum(quorum.quorum_id, quorum.participants, quorum.created):
            if (event.replica_id, event.step) not in seen:
                self.heals.insert(0, event)
        del self.heals[HEALS_KEPT:]

    async def take_replica_group(self, spare_id: str, wanted: str) -> str:
        """Waits until the caller may train as a replica group; returns its name."""
        if not spare_id:
            raise ValueError("spare_id must be a non-empty string")
        waiter = _SpareWaiter(
            SpareRequest(spare_id, wanted, time.monotonic()),
            asyncio.get_running_loop().create_future(),
        )
        self.spares.append(waiter)
        self.metrics.spares_waiting.set(len({w.request.spare_id for w in self.spares}))
        self.place_spares()
        try:
            return await asyncio.shield(waiter.future)
        finally:
            if waiter in self.spares:
                self.spares.remove(waiter)
                self.metrics.spares_waiting.set(len({w.request.spare_id for w in self.spares}))

    def place_spares(self) -> None:
        """Answers every waiting spare that can take a group now (lighthouse.spares)."""
        now = time.monotonic()
        remember_s = self.config.forget_after_s
        for sid in [sid for sid, (_, at) in self.held.items() if now - at >= remember_s]:
            del self.held[sid]
        if not self.spares:
            return
        placed = assign_groups(
            now,
            [w.request for w in self.spares],
            self.by_name.keys(),
            {group_name(rid) for rid in self._healthy(now)},
            {sid: group for sid, (group, _) in self.held.items()},
            self.reserved,
            reserve_s=max(5.0, 2 * self.config.heartbeat_timeout_ms / 1000),
        )
        for waiter in list(self.spares):
            sid, wanted = waiter.request.spare_id, waiter.request.wanted
            group = placed.get(sid)
            if group is None:
                continue
            if sid not in self.held:
                self.held[sid] = (group, now)
                self.reserved[group] = now
                if group != wanted:
                    self.metrics.spare_promotions.inc()
                logger.info(
                    "%s %s trains as replica group %s%s",
                    "spare" if group != wanted else "process",
                    sid,
                    group,
                    " (its replicas died)" if group != wanted else "",
                )
            self.spares.remove(waiter)
            if not waiter.future.done():
                waiter.future.set_result(group)
        self.metrics.spares_waiting.set(len({w.request.spare_id for w in self.spares}))

    def decide_soon(self) -> None:
        """Decides once for all the calls that arrive meanwhile. A decision
        costs O(replicas), so deciding per call is O(replicas^2) a step; the
        next one waits until 10x the last one's cost has passed, which keeps
        decisions under ~10% of the loop (20 us with 2 replicas, ~10 ms with
        a thousand)."""
        if self._decide_soon:
            return
        self._decide_soon = True
        loop = asyncio.get_running_loop()
        wait = self._decided_at + DECIDE_COST_FACTOR * self._decide_cost_s - time.perf_counter()
        if wait > 0:
            loop.call_later(wait, self._decide_now)
        else:
            loop.call_soon(self._decide_now)

    def _decide_now(self) -> None:
        self._decide_soon = False
        if self.waiters:
            start = time.perf_counter()
            self.decide()
            self._decided_at = time.perf_counter()
            self._decide_cost_s = self._decided_at - start

    def decide(self) -> None:
        now = time.monotonic()
        state = LighthouseState(
            {rid: w.participant for rid, w in self.waiters.items()},
            self.heartbeats,
            self.prev_quorum,
            streams_closed=self.streams_closed,
            started_at=self.started_at,
            arrivals=self.arrivals,
            described=self.members,
        )
        decision = compute_quorum(now, state, self.decide_config)
        self.reason = decision.reason
        for rid, why in decision.refused.items():
            self._refuse(rid, why)
        if decision.members is None:
            self._report_waiting(now, decision.kind, decision.reason)
            return
        after_stall, self._logged_status = self._logged_status is not None, None
        self.summary = f"quorum issued: {decision.reason}"
        changed = quorum_changed(self.prev_quorum, decision.members)
        if changed:
            self.quorum_id = next_quorum_id(self.quorum_id, int(time.time() * 1000))
        quorum = Quorum(self.quorum_id, decision.members, time.time())
        self._record_quorum(quorum, changed, decision.reason, now)
        self.prev_quorum = quorum
        self.metrics.on_quorum(quorum)
        # A new quorum is news, and so is the end of a logged stall; the
        # same members again (every step) is not.
        level = logging.INFO if changed or after_stall else logging.DEBUG
        if logger.isEnabledFor(level):  # the member list costs O(members) to format
            logger.log(
                level,
                "quorum %d issued (%s): %s",
                quorum.quorum_id,
                decision.reason,
                ", ".join(f"{m.replica_id} step={m.step}" for m in quorum.participants),
            )
        for member in quorum.participants:
            waiter = self.waiters.pop(member.replica_id)
            if not waiter.future.done():
                waiter.future.set_result(quorum)
        # Callers left out join again: their join timeout starts over.
        for waiter in self.waiters.values():
            waiter.participant = replace(waiter.participant, joined_at=now)

    def _refuse(self, replica_id: str, why: str) -> None:
        """Answers a waiting replica of another rendezvous with the reason (logged once)."""
        waiter = self.waiters.pop(replica_id, None)
        if waiter is None:
            return
        if replica_id not in self._refusals_logged and len(self._refusals_logged) < 10_000:
            self._refusals_logged.add(replica_id)
            logger.warning("refusing %s: %s", replica_id, why)
        if not waiter.future.done():
            waiter.future.set_exception(IncompatibleGroupError(why))

    def tick(self) -> None:
        now = time.monotonic()
        for rid in forgotten_replicas(now, self.heartbeats, self.config.forget_after_s):
            if rid not in self.waiters:
                logger.info(
                    "forgetting replica %s: silent for over %.0f s", rid, self.config.forget_after_s
                )
                self._forget(rid)
                self._departed(rid, f"forgotten: silent over {self.config.forget_after_s:.0f} s")
        self.repace()
        if self.waiters:
            self.decide()
        self.place_spares()  # groups silent past the heartbeat timeout are free now
        self.metrics.healthy_replicas.set(len(self._healthy(now)))

    def _healthy(self, now: float) -> set[str]:
        return healthy_replicas(
            now, self.heartbeats, self.config.heartbeat_timeout_ms, self.streams_closed
        )

    def _report_waiting(self, now: float, kind: str, reason: str) -> None:
        """Mid-step waits at DEBUG; a stall at INFO, one line per change of
        its reason's kind or of the healthy count: not one per tick, nor one
        per joining replica (a thousand replicas joining is one line)."""
        healthy = self._healthy(now)
        first_joined_at = min(w.participant.joined_at for w in self.waiters.values())
        num_joined = sum(1 for rid in self.waiters if rid in healthy)
        report = waiting_report(now, first_joined_at, num_joined, len(healthy), reason)
        self.summary = report.summary
        if not report.stalled:
            logger.debug("quorum status: %s", reason)
            return
        key = (kind, len(healthy))
        if key != self._logged_status:
            self._logged_status = key
            logger.info("quorum status: %s", report.summary)

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        healthy = self._healthy(now)
        in_quorum = set(self.prev_quorum.replica_ids()) if self.prev_quorum else set()
        replicas = []
        rates = {
            name: step_rate(g.commits, g.first_seen, now, RATE_WINDOW_S)
            for name, g in self.progress.groups.items()
        }
        for rid in sorted(self.heartbeats):
            member = self.members.get(rid, QuorumMember(replica_id=rid))
            replicas.append(
                {
                    "replica_id": rid,
                    "step": member.step,
                    "step_rate": round(rates.get(group_name(rid), 0.0), 3),
                    "address": member.address,
                    "heartbeat_age_s": round(now - self.heartbeats[rid], 3),
                    "healthy": rid in healthy,
                    "waiting": rid in self.waiters,
                    "in_quorum": rid in in_quorum,
                }
            )
        wall = time.time()
        groups = [
            {
                "name": name,
                "step": g.last_step,
                "committed": g.committed,
                "step_rate": round(rates[name], 3),
                "goodput": self.progress.group_goodput(name),
                "last_seen": wall - (now - g.last_seen),
                "points": [[round(t, 3), s] for t, s in g.points or ()],
            }
            for name, g in self.progress.groups.items()
        ]
        return {
            "now": wall,
            "quorum_id": self.prev_quorum.quorum_id if self.prev_quorum else None,
            "quorum_members": sorted(in_quorum),
            "reason": self.reason,
            "summary": self.summary,
            "min_replicas": self.config.min_replicas,
            "replicas": replicas,
            "groups": groups,
            "rate_window_s": RATE_WINDOW_S,
            "goodput": {
                "value": self.progress.job_goodput(),
                "max_groups_in_quorum": self.progress.max_groups_in_quorum,
                "steps_advanced": self.progress.steps_advanced(),
            },
            "history": [
                {
                    "time": e.time,
                    "quorum_id": e.quorum_id,
                    "members": list(e.members),
                    "joined": [{"replica_id": c.replica_id, "why": c.why} for c in e.joined],
                    "left": [{"replica_id": c.replica_id, "why": c.why} for c in e.left],
                    "note": e.note,
                }
                for e in self.history
            ],
            "heals": [
                {
                    "time": h.time,
                    "replica_id": h.replica_id,
                    "sources": list(h.sources),
                    "step": h.step,
                    "quorum_id": h.quorum_id,
                    "seconds": h.seconds,
                    "bytes": h.num_bytes,
                }
                for h in self.heals
            ],
            "spares": sorted(
                {
                    w.request.spare_id: {
                        "spare_id": w.request.spare_id,
                        "wanted": w.request.wanted,
                        "waiting_s": round(now - w.request.since, 3),
                    }
                    for w in self.spares
                }.values(),
                key=lambda spare: -spare["waiting_s"],
            ),
        }


class _LighthouseServicer:
    """LighthouseService, registered by its method names. Thin: converts,
    calls the coordinator, converts back, maps errors (lighthouse.rpc.errors)."""

    def __init__(self, coordinator: _Coordinator) -> None:
        self._coord = coordinator
        self._response: tuple[Quorum | None, bytes] = (None, b"")

    def _quorum_response(self, quorum: Quorum) -> bytes:
        """Converts and serializes each issued quorum once: every member's call
        returns the same bytes (decode_guard passes bytes through), where
        doing either per call is O(members^2) a step."""
        if self._response[0] is not quorum:
            response = pb.LighthouseQuorumResponse(quorum=wire.quorum_to_proto(quorum))
            self._response = (quorum, response.SerializeToString())
        return self._response[1]

    async def Quorum(
        self, request: pb.LighthouseQuorumRequest, context: aio.ServicerContext[Any, Any]
    ) -> bytes:
        start = time.monotonic()
        budget_s = reply_budget_s(context.time_remaining())
        try:
            member = wire.quorum_request_from_proto(request)
            waiter = self._coord.join(member)
            try:
                # A future and a timer: cheaper per call than a task (wait_within).
                quorum = await asyncio.wait_for(waiter.future, budget_s)
            except asyncio.TimeoutError:
                if waiter.future.cancelled():  # wait_for's own timeout
                    raise QuorumTimeoutError(
                        f"no quorum containing {member.replica_id} within {budget_s:.1f} s: "
                        f"{self._coord.reason}"
                    ) from None
                raise
            finally:
                self._coord.withdraw(waiter)
        except Exception as e:
            await errors.abort(context, e)
        self._coord.metrics.quorum_latency.observe(time.monotonic() - start)
        return self._quorum_response(quorum)

    async def Heartbeat(
        self, request: pb.LighthouseHeartbeatRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.LighthouseHeartbeatResponse:
        if not request.replica_id:
            await errors.abort(context, ValueError("replica_id must be a non-empty string"))
        try:
            self._coord.heartbeat(request.replica_id)
        except DuplicateGroupError as e:
            await errors.abort(context, e)
        return pb.LighthouseHeartbeatResponse()

    async def HeartbeatStream(
        self, request_iterator: Any, context: aio.ServicerContext[Any, Any]
    ) -> pb.LighthouseHeartbeatResponse:
        await self._heartbeats(request_iterator, context, advise=False)
        return pb.LighthouseHeartbeatResponse()

    async def HeartbeatPaced(
        self, request_iterator: Any, context: aio.ServicerContext[Any, Any]
    ) -> None:
        """HeartbeatStream that answers with the period to heartbeat at
        (lighthouse.pacing): on the first heartbeat and after each change."""
        await self._heartbeats(request_iterator, context, advise=True)

    async def _heartbeats(
        self, request_iterator: Any, context: aio.ServicerContext[Any, Any], advise: bool
    ) -> None:
        replica_id = ""
        advised = 0
        try:
            async for request in request_iterator:
                if request.replica_id != replica_id:
                    if not request.replica_id:
                        await errors.abort(
                            context, ValueError("replica_id must be a non-empty string")
                        )
                    if replica_id:
                        await errors.abort(
                            context,
                            ValueError(
                                f"one heartbeat stream carries one replica_id: got "
                                f"{request.replica_id!r} after {replica_id!r}; open a stream each"
                            ),
                        )
                    replica_id = request.replica_id
                    self._coord.stream_opened(replica_id)
                try:
                    self._coord.heartbeat(replica_id)
                except DuplicateGroupError as e:
                    await errors.abort(context, e)
                if advise and advised != self._coord.advice_ms:
                    advised = self._coord.advice_ms
                    await context.write(pb.LighthouseHeartbeatAdvice(interval_ms=advised))
        finally:
            # Also on cancellation: the client's connection closed under us.
            if replica_id:
                self._coord.stream_ended(replica_id)

    async def TakeReplicaGroup(
        self, request: pb.TakeReplicaGroupRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.TakeReplicaGroupResponse:
        """The group to train as, or "" when the call's deadline comes first
        (the caller asks again: a spare may wait for hours)."""
        try:
            group = await wait_within(
                self._coord.take_replica_group(request.spare_id, request.wanted),
                reply_budget_s(context.time_remaining()),
                lambda: QuorumTimeoutError("no group yet"),
            )
        except QuorumTimeoutError:
            group = ""
        except Exception as e:
            await errors.abort(context, e)
        return pb.TakeReplicaGroupResponse(replica_group=group)

    async def Leave(
        self, request: pb.LighthouseLeaveRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.LighthouseLeaveResponse:
        if not request.replica_id:
            await errors.abort(context, ValueError("replica_id must be a non-empty string"))
        self._coord.leave(request.replica_id)
        return pb.LighthouseLeaveResponse()


class LighthouseServer:
    """A lighthouse running in the background of the calling process.

    Starts in the constructor; `address()` is its `http://host:port` URL and
    `shutdown()` is idempotent. Quorum ids start at the wall clock in
    milliseconds and never go below it (see `next_quorum_id`), so a restarted
    lighthouse never repeats an id without persisting any state. With a
    `secret`, every call must carry it (lighthouse.rpc.auth); None: open to all.
    With `tls`, it serves TLS (lighthouse.rpc.tls) and its address is https://.
    With `kill_button` (and a secret), the status page has a kill form per
    replica (see `kill`); off by default, as the page is open to all readers.

    Args:
        bind: `host:port` to listen on (port 0 picks one).
        min_replicas: fewest replica groups a quorum may have.
        join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms, suspect_phi,
            suspect_min_ms: the quorum rule's options (lighthouse.quorum.LighthouseConfig).
        http_bind: `host:port` of the status page and /metrics; None: no page.
        secret: the job's shared secret, or None.
        tls: serve TLS with this configuration, or None for plaintext.
        kill_button: offer a kill form per replica on the status page.

    Raises:
        ValueError: a bad option or an unparsable bind address.
        OSError: the port is already in use.
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int = 60000,
        quorum_tick_ms: int = 100,
        heartbeat_timeout_ms: int = 5000,
        http_bind: str | None = None,
        secret: str | None = None,
        suspect_phi: float = 8.0,
        suspect_min_ms: int = 700,
        tls: TLSConfig | None = None,
        kill_button: bool = False,
    ) -> None:
        if tls is not None:
            tls.require_server("lighthouse")
        self.config = LighthouseConfig(
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            suspect_phi=suspect_phi,
            suspect_min_ms=suspect_min_ms,
        )
        host, port = parse_bind(bind)
        self.metrics = LighthouseMetrics()
        self._coord = _Coordinator(self.config, self.metrics)
        self._loop = BackgroundLoop("lighthouse")
        self._http = None
        self._stopped = False
        self._secret = secret
        self._tls = tls
        self._kill_button = kill_button
        try:
            self._port = self._loop.run(self._start(host, port))
            self._host = advertised_host(host)
            if http_bind is not None:
                self._http = StatusServer(http_bind, self.status, self.metrics.render, self.kill)
        except BaseException:
            self.shutdown()
            raise
        logger.info("lighthouse listening on %s (gRPC, bind %s)", self.address(), bind)
        logger.info("access control: %s", "on (shared secret)" if secret else "off (no secret)")
        logger.info("transport: %s", _describe(tls))
        warning = auth.exposure_warning(secret, host, "lighthouse")
        if warning:
            logger.warning("%s", warning)

    async def _start(self, host: str, port: int) -> int:
        self._server = serve.new_server(
            pb_grpc.add_LighthouseServiceServicer_to_server,
            _LighthouseServicer(self._coord),
            self._secret,
            "lighthouse",
        )
        bound = serve.bind(
            self._server, host, port, "choose another --bind port (0 picks a free one)", self._tls
        )
        await self._server.start()
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        return bound

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.quorum_tick_ms / 1000)
            try:
                self._coord.tick()
            except Exception:
                logger.exception("lighthouse tick failed; continuing")

    def address(self) -> str:
        return f"{scheme(self._tls)}://{join_host_port(self._host, self._port)}"

    def http_address(self) -> str | None:
        return self._http.address() if self._http else None

    def status(self) -> dict[str, Any]:
        """The status page's data (thread-safe: read on the server's loop)."""
        snapshot: dict[str, Any] = self._loop.run(self._async(self._coord.snapshot), timeout=5)
        snapshot["kill"] = {"enabled": self._kill_button, "secret_set": self._secret is not None}
        return snapshot

    def kill(self, replica_id: str, typed_secret: str, peer: str) -> tuple[int, str]:
        """The status page's kill button: sends Kill to `replica_id`'s
        ManagerServer, with the job's secret, if `typed_secret` is that secret.

        Refused (403) when the button is off, when the job has no secret (the
        ManagerServer would refuse a Kill without one too: with no secret
        nothing tells who asks) and when the typed secret is wrong (compared
        in constant time). Returns (HTTP status, message for the operator).
        """
        if self._secret is None:
            return 403, (
                "kill refused: this job has no shared secret, so nothing can tell who asks "
                "(the ManagerServers refuse Kill without one too); start the lighthouse and "
                f"every replica group with {auth.SECRET_FILE_ENV} set to a file holding the "
                "secret, and the lighthouse with --kill-button"
            )
        if not self._kill_button:
            return 403, (
                "kill refused: the kill button is off; start the lighthouse with --kill-button"
            )
        if not hmac.compare_digest(typed_secret.encode(), self._secret.encode()):
            logger.warning("status page: kill of %s refused to %s: wrong secret", replica_id, peer)
            return 403, "kill refused: that is not the job's secret"
        member = self._loop.run(self._async(lambda: self._coord.members.get(replica_id)), 5)
        if member is None or not member.address:
            return 404, f"kill refused: no replica {replica_id!r} with a known address"
        target = member.address.split("://", 1)[-1]
        logger.warning("status page: %s asked to kill %s (%s)", peer, replica_id, target)
        ch = channel.blocking_channel(target, self._secret, self._tls)
        try:
            stub = pb_grpc.ManagerServiceStub(ch)
            stub.Kill(
                pb.KillRequest(msg=f"killed from the lighthouse status page by {peer}"),
                timeout=KILL_TIMEOUT_S,
            )
        except Exception as e:
            why = e.details() if isinstance(e, grpc.RpcError) else str(e)
            return 502, f"kill of {replica_id} at {member.address} failed: {why}"
        finally:
            ch.close()
        return 200, f"Kill sent to {replica_id} at {member.address}"

    @staticmethod
    async def _async(fn: Any) -> Any:
        return fn()

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._http is not None:
            self._http.shutdown()
        if hasattr(self, "_server"):
            self._loop.run(self._stop(), timeout=10)
        self._loop.stop()

    async def _stop(self) -> None:
        if hasattr(self, "_ticker"):
            self._ticker.cancel()
        # Answer waiting Quorum calls before the server cancels their handlers
        # (a cancelled handler is logged by grpc as an unhandled error).
        waiting: list[asyncio.Future[Any]] = [
            w.future for w in self._coord.waiters.values() if not w.future.done()
        ]
        for future in waiting:
            future.set_exception(QuorumError("the lighthouse is shutting down"))
        spares = [w.future for w in self._coord.spares if not w.future.done()]
        for spare in spares:
            spare.set_result("")  # "ask again": a spare outlives a lighthouse restart
        waiting += spares
        if waiting:
            await asyncio.sleep(0.05)  # lets their handlers send the answer
        await self._server.stop(grace=None)


def _describe(tls: TLSConfig | None) -> str:
    if tls is None:
        return "plaintext (no TLS)"
    return "TLS, client certificates " + ("required" if tls.client_auth else "not required")
