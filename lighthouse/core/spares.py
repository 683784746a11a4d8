"""Hot spares: which waiting process trains as which replica group.

A spare is a process that has done all of its start-up (torchrun, imports,
model, optimizer) and waits in a TakeReplicaGroup call. When a replica
group dies, the lighthouse hands its name to the spare that has waited
longest, which joins the next quorum and heals: no operator, no cold start.
A group restarting under its own name asks the same way, wanting that name:
it gets it when the name is free, and waits as a spare when a spare took it.

Pure: the server passes the clock and its state in (see lighthouse.shell.server).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpareRequest:
    """One waiting TakeReplicaGroup call (every rank of a spare makes one)."""

    spare_id: str
    """Shared by the ranks of one spare process group (one torchrun)."""
    wanted: str
    """The group name it would rather train as ("" for none)."""
    since: float
    """Monotonic seconds when it started waiting."""


def assign_groups(
    now: float,
    waiting: Sequence[SpareRequest],
    known_groups: Iterable[str],
    live_groups: set[str],
    held: Mapping[str, str],
    reserved: Mapping[str, float],
    reserve_s: float,
) -> dict[str, str]:
    """spare_id -> the group name each waiting spare trains as from now.

    In this order:
      1. a spare handed a group already (another of its ranks asked first)
         gets that group again;
      2. a spare wanting a group that is neither live nor reserved gets it
         (a group's first start, or its own restart);
      3. the groups known to have lived that have no live replica and are
         not reserved go, sorted by name, to the spares that waited longest.
    A group handed out is reserved until a replica of it is live (the caller
    drops the reservation then) or `reserve_s` has passed (the spare died
    before it joined), so no group goes to two spares.

    Args:
        known_groups: names of every group the lighthouse knows a replica of.
        live_groups: names with a healthy replica.
        held: spare_id -> the group it was handed earlier.
        reserved: group -> monotonic seconds when it was handed out.
    """
    taken = set(live_groups) | {g for g, at in reserved.items() if now - at < reserve_s}
    out: dict[str, str] = {}
    unplaced: list[str] = []
    for request in sorted(waiting, key=lambda r: (r.since, r.spare_id)):
        sid = request.spare_id
        if sid in out or sid in unplaced:
            continue
        if sid in held:
            out[sid] = held[sid]
        elif request.wanted and request.wanted not in taken:
            out[sid] = request.wanted
            taken.add(request.wanted)
        else:
            unplaced.append(sid)
    vacant = sorted(set(known_groups) - taken)
    out.update(zip(unplaced, vacant))
    return out
