"""The quorum history of the status page: each quorum change with who joined or
left and why, and the refusals between them.

Pure: the server passes in the time and what it knows of each replica, so
every reason is a plain function of its inputs (tests/unit/test_history.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lighthouse.core.quorum import (
    ArrivalStats,
    LighthouseConfig,
    group_name,
    healthy_replicas,
    stream_closed_since_heartbeat,
    suspected_replicas,
)

HISTORY_LENGTH = 100
"""Entries kept (newest first); older ones are dropped."""


@dataclass(frozen=True)
class Change:
    """One replica's arrival or departure, and why."""

    replica_id: str
    why: str


@dataclass(frozen=True)
class HistoryEntry:
    """A new quorum (`quorum_id` set) or an event between quorums (a refusal)."""

    time: float
    """Wall-clock seconds."""
    quorum_id: int | None
    members: tuple[str, ...] = ()
    joined: tuple[Change, ...] = ()
    left: tuple[Change, ...] = ()
    note: str = ""
    """The decision's reason, or what happened (e.g. a refused twin)."""


def why_absent(
    now: float,
    replica_id: str,
    heartbeats: Mapping[str, float],
    streams_closed: Mapping[str, float],
    arrivals: Mapping[str, ArrivalStats],
    config: LighthouseConfig,
    departed: Mapping[str, str],
) -> str:
    """Why a member of the previous quorum is not in the next one.

    Args:
        departed: replicas the lighthouse dropped since (a Leave, or forgotten
            after a long silence) -> what happened.
    """
    if replica_id in departed:
        return departed[replica_id]
    if replica_id not in heartbeats:
        return "forgotten"
    if replica_id in stream_closed_since_heartbeat(heartbeats, streams_closed):
        return "heartbeat stream closed (process or connection gone)"
    silence_s = now - heartbeats[replica_id]
    if replica_id not in healthy_replicas(now, heartbeats, config.heartbeat_timeout_ms):
        return f"heartbeat lost: silent {silence_s:.1f} s, past the heartbeat timeout"
    if replica_id in suspected_replicas(now, heartbeats, arrivals, config):
        mean_s = arrivals[replica_id].mean_s
        return (
            f"suspected hung by phi accrual: silent {silence_s:.1f} s, usually every {mean_s:.2f} s"
        )
    return "healthy but did not ask in time (join timeout, or a shrink_only quorum)"


def why_joined(replica_id: str, ever_in_quorum: set[str], names_in_quorum: set[str]) -> str:
    """Why a replica is in the next quorum and was not in the previous one.

    Args:
        ever_in_quorum: replica ids seen in an earlier quorum.
        names_in_quorum: group names (lighthouse.core.quorum.group_name) seen in one.
    """
    if replica_id in ever_in_quorum:
        return "back after missing a quorum"
    name = group_name(replica_id)
    if name != replica_id and name in names_in_quorum:
        return f"new process of group {name!r} (restarted)"
    return "new"


def quorum_entry(
    time: float,
    quorum_id: int,
    prev_ids: tuple[str, ...],
    members: tuple[str, ...],
    reason: str,
    absent_why: Mapping[str, str],
    ever_in_quorum: set[str],
    names_in_quorum: set[str],
) -> HistoryEntry:
    """The entry of a new quorum; `absent_why` holds `why_absent` for each
    previous member not in `members` (see why_joined for the sets)."""
    new = set(members)
    old = set(prev_ids)
    joined = tuple(
        Change(rid, why_joined(rid, ever_in_quorum, names_in_quorum))
        for rid in members
        if rid not in old
    )
    left = tuple(
        Change(rid, absent_why.get(rid, "not in the quorum")) for rid in prev_ids if rid not in new
    )
    return HistoryEntry(time, quorum_id, members, joined, left, reason)
