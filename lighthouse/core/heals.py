"""Heal events as the lighthouse sees them: who copied the live state from whom, at
which step, and (when the group reports it) how long it took and how many bytes.

How the numbers reach the lighthouse, and why this way: the lighthouse derives
who heals from the quorums it issues (a member behind the max step heals from
the members at it: docs/architecture.md, "Healing"), so heals of pytorch/torchft groups show
too. Duration and bytes only the group knows; the step after a heal, each rank
reports its heal in `ManagerQuorumRequest.heal_report` (field 101, additive)
and the ManagerServer merges them into `QuorumMember.data["heal"]`, a key of
the JSON dict that `data` already is (the fingerprint travels the same way;
lighthouse.core.member_data owns the keys and their JSON).
A pytorch/torchft ManagerServer ignores field 101 and a pytorch/torchft
lighthouse forwards `data` unchanged, so nothing breaks; a torchft user who
reads `data` sees one more key, once per heal. The other option, the status
page scraping each group's metrics endpoint, would make the lighthouse open
connections to every group on every page load and need their metrics ports.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

# HEAL_KEY: the status page's server skips members whose data lacks it
# without parsing; it imports it from here.
from lighthouse.core.member_data import HEAL_KEY as HEAL_KEY
from lighthouse.core.member_data import HealReport, heal_report_of
from lighthouse.core.quorum import QuorumMember


@dataclass(frozen=True)
class HealEvent:
    replica_id: str
    step: int
    """The step whose state it copied."""
    sources: tuple[str, ...]
    """Replica ids it copied from (or addresses, when not known)."""
    time: float
    """Wall-clock seconds when the lighthouse saw it."""
    quorum_id: int | None = None
    """The quorum that made it heal; None when only the report told (init_sync at step 0)."""
    seconds: float | None = None
    num_bytes: int | None = None


def report_of(member: QuorumMember) -> HealReport | None:
    """The heal report in `member.data`, or None (none, or not ours: a
    pytorch/torchft peer may put anything in `data`)."""
    return heal_report_of(member.data)


def heals_in_quorum(
    quorum_id: int, members: tuple[QuorumMember, ...], time: float
) -> list[HealEvent]:
    """Members behind the quorum's max step, each with the replica its group
    rank 0 copies from (docs/architecture.md, "Healing"): the i-th behind (in replica id
    order) takes the up-to-date member at index i mod their count (rank r:
    (i + r) mod count). Members are sorted by replica id, as in a quorum."""
    if not members:
        return []
    max_step = max(m.step for m in members)
    ahead = [m.replica_id for m in members if m.step == max_step]
    behind = [m.replica_id for m in members if m.step < max_step]
    return [
        HealEvent(rid, max_step, (ahead[i % len(ahead)],), time, quorum_id)
        for i, rid in enumerate(behind)
    ]


def apply_report(
    events: list[HealEvent],
    replica_id: str,
    report: HealReport,
    time: float,
    names_by_address: Mapping[str, str],
) -> HealEvent | None:
    """Fills the event of (replica_id, report.step) in `events` (newest
    first) with the report's numbers, in place, and returns it; appends a new
    event when the lighthouse saw no such heal (init_sync at step 0 makes a
    member heal at the max step). Returns None when that heal already has numbers."""
    sources = tuple(names_by_address.get(a, a) for a in report.sources)
    for i, event in enumerate(events):
        if event.replica_id == replica_id and event.step == report.step:
            if event.seconds is not None:
                return None
            events[i] = replace(
                event,
                seconds=report.seconds,
                num_bytes=report.num_bytes,
                sources=sources or event.sources,
            )
            return events[i]
    event = HealEvent(
        replica_id, report.step, sources, time, None, report.seconds, report.num_bytes
    )
    events.insert(0, event)
    return event
