"""The status page's memory: quorum history, heals and progress, fed by the
membership's effects, and the page's data (`snapshot`).

An observer of lighthouse.core.membership: `observe` takes each effect the server
applies, with the time the server read; `snapshot` reads the membership's
current state beside the memory. Pure: no clock reads, no I/O; each piece
of memory is bounded (lighthouse.core.history, .heals, .progress).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from lighthouse.core.effects import Effect, Forgotten, Issued, Joined, TwinRefused
from lighthouse.core.heals import HEAL_KEY, HealEvent, apply_report, heals_in_quorum, report_of
from lighthouse.core.history import HISTORY_LENGTH, HistoryEntry, quorum_entry
from lighthouse.core.membership import Membership
from lighthouse.core.quorum import QuorumMember, group_name
from lighthouse.status.progress import RATE_WINDOW_S, Progress, step_rate

HEALS_KEPT = 50
"""Heal events the status page keeps (newest first)."""
MAX_NAMES_KEPT = 100_000
"""Group names remembered from quorums, to tell a restart (lighthouse.core.history.why_joined)."""


class StatusView:
    """What the status page remembers of the job, and shows of `membership`."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.history: deque[HistoryEntry] = deque(maxlen=HISTORY_LENGTH)
        self.heals: list[HealEvent] = []
        self.progress = Progress()
        self.ever_in_quorum: set[str] = set()
        self.names_in_quorum: set[str] = set()
        """Group names seen in a quorum (at most MAX_NAMES_KEPT), to tell a restart."""

    def observe(self, effects: Iterable[Effect], now: float, wall: float) -> None:
        """Records the effects the status page shows (monotonic and wall seconds)."""
        for effect in effects:
            if isinstance(effect, Joined):
                self._joined(effect.member, now, wall)
            elif isinstance(effect, Issued):
                self._issued(effect)
            elif isinstance(effect, Forgotten):
                self.ever_in_quorum.discard(effect.replica_id)
            elif isinstance(effect, TwinRefused):
                note = f"twin refused: {effect.reason.split(';')[0]}"
                self.history.appendleft(HistoryEntry(wall, None, note=note))

    def _joined(self, member: QuorumMember, now: float, wall: float) -> None:
        """Records the step of a Quorum call and any heal report it carries."""
        self.progress.observe(group_name(member.replica_id), member.step, wall, now)
        if isinstance(member.data, str) and HEAL_KEY not in member.data:
            return  # the usual case: no JSON to parse
        report = report_of(member)
        if report is not None:
            described = self.membership.described
            by_address = {m.address: rid for rid, m in described.items() if m.address}
            if apply_report(self.heals, member.replica_id, report, wall, by_address):
                del self.heals[HEALS_KEPT:]

    def _issued(self, issued: Issued) -> None:
        """History, heals and progress of an issued quorum."""
        quorum = issued.quorum
        self.progress.on_quorum(len(quorum.participants))
        ids = quorum.replica_ids()
        if issued.changed:
            self.history.appendleft(
                quorum_entry(
                    quorum.created,
                    quorum.quorum_id,
                    issued.prev_ids,
                    ids,
                    issued.reason,
                    issued.absent,
                    self.ever_in_quorum,
                    self.names_in_quorum,
                )
            )
            self.ever_in_quorum.update(ids)
            if len(self.names_in_quorum) < MAX_NAMES_KEPT:
                self.names_in_quorum.update(group_name(rid) for rid in ids)
        seen = {(h.replica_id, h.step) for h in self.heals}
        for event in heals_in_quorum(quorum.quorum_id, quorum.participants, quorum.created):
            if (event.replica_id, event.step) not in seen:
                self.heals.insert(0, event)
        del self.heals[HEALS_KEPT:]

    def last_failure(self) -> dict[str, Any] | None:
        """The latest quorum some member left (wall time, who, why), or None."""
        for entry in self.history:
            if entry.left:
                return {
                    "time": entry.time,
                    "quorum_id": entry.quorum_id,
                    "left": [{"replica_id": c.replica_id, "why": c.why} for c in entry.left],
                }
        return None

    def snapshot(self, now: float, wall: float) -> dict[str, Any]:
        """The status page's data (lighthouse.status.dashboard.render_page)."""
        m = self.membership
        healthy = m.healthy(now)
        in_quorum = set(m.prev_quorum.replica_ids()) if m.prev_quorum else set()
        rates = {
            name: step_rate(g.commits, g.first_seen, now, RATE_WINDOW_S)
            for name, g in self.progress.groups.items()
        }
        replicas = []
        for rid in sorted(m.heartbeats):
            member = m.described.get(rid, QuorumMember(replica_id=rid))
            replicas.append(
                {
                    "replica_id": rid,
                    "step": member.step,
                    "step_rate": round(rates.get(group_name(rid), 0.0), 3),
                    "address": member.address,
                    "heartbeat_age_s": round(now - m.heartbeats[rid], 3),
                    "healthy": rid in healthy,
                    "waiting": rid in m.participants,
                    "in_quorum": rid in in_quorum,
                }
            )
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
            "quorum_id": m.prev_quorum.quorum_id if m.prev_quorum else None,
            "quorum_members": sorted(in_quorum),
            "reason": m.reason,
            "summary": m.summary,
            "min_replicas": m.config.min_replicas,
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
                    request.spare_id: {
                        "spare_id": request.spare_id,
                        "wanted": request.wanted,
                        "waiting_s": round(now - request.since, 3),
                    }
                    for _, request in m.spares
                }.values(),
                key=lambda spare: -spare["waiting_s"],
            ),
        }
