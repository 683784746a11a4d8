"""Which members of the latest quorum are gone, and who must hear of it.

Why: a replica group that dies or hangs inside a collective holds every
other member of that collective until the collective timeout (tens of
seconds), though the lighthouse knows within about a heartbeat timeout that
it is gone: its heartbeat stream closed (dead), it is silent past the
heartbeat timeout, or silent far past its rhythm (hung, phi accrual). So the
lighthouse tells the quorum's other members on their HeartbeatPaced streams
(`LighthouseGoneNotice`), and their Managers abort the collectives they
share with it (torchft_like.manager.gone_watch).

A notice names every member judged gone so far, for one quorum id; the set
only grows until the next quorum is issued, and the membership never issues
that quorum id again (see `GoneWatch.any_gone`), so a notice can never
name a later quorum's collectives. A gone member whose heartbeats come back
(a SIGCONT) is told too: its own collective of that quorum must not commit.

Pure: the time is passed in (tests/unit/test_gone.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass

from lighthouse.core.quorum import ArrivalStats, LighthouseConfig, suspected_replicas


@dataclass(frozen=True)
class GoneNotice:
    """Quorum `quorum_id`'s members judged gone so far, for `recipients`."""

    quorum_id: int
    gone: tuple[str, ...]
    """Sorted replica ids."""
    recipients: tuple[str, ...]
    """Sorted replica ids to tell."""


def judge_gone(
    now: float,
    members: Iterable[str],
    heartbeats: Mapping[str, float],
    streams_closed: Mapping[str, float],
    arrivals: Mapping[str, ArrivalStats],
    config: LighthouseConfig,
) -> dict[str, str]:
    """Members that will not finish a collective -> why, by the quorum
    rule's own tests (lighthouse.core.quorum): forgotten or left, heartbeat
    stream closed since its last heartbeat, silent past the heartbeat
    timeout, or suspected hung."""
    timeout_s = config.heartbeat_timeout_ms / 1000
    judged: dict[str, str] = {}
    silent: dict[str, float] = {}
    for rid in members:
        seen = heartbeats.get(rid)
        if seen is None:
            judged[rid] = "left or forgotten"
        elif streams_closed.get(rid, float("-inf")) >= seen:
            judged[rid] = "heartbeat stream closed (process or connection gone)"
        elif now - seen >= timeout_s:
            judged[rid] = f"silent {now - seen:.1f} s, past the heartbeat timeout"
        else:
            silent[rid] = seen
    for rid, silence_s in suspected_replicas(now, silent, arrivals, config).items():
        judged[rid] = f"suspected hung: silent {silence_s:.1f} s"
    return judged


@dataclass(frozen=True)
class Gone:
    """The membership's effect: tell `notice.recipients` on their streams."""

    notice: GoneNotice


class GoneWatch:
    """The latest quorum's gone members, and who has been told.

    `issued` starts over with each issued quorum; `judge` finds the members
    gone now and returns the notice for the others when the set grew;
    `heard_from` returns one for a gone member heard from again.
    """

    def __init__(self) -> None:
        self.quorum_id: int | None = None
        self.members: tuple[str, ...] = ()
        self._member_set: frozenset[str] = frozenset()
        self.gone: dict[str, str] = {}
        """Member -> why it was judged gone (kept until the next quorum)."""
        self._told_back: dict[str, int] = {}
        """Gone member heard from again -> how many gone members it was told of."""

    def issued(self, quorum_id: int, members: Iterable[str]) -> None:
        self.quorum_id = quorum_id
        self.members = tuple(members)
        self._member_set = frozenset(self.members)
        self.gone = {}
        self._told_back = {}

    def any_gone(self) -> bool:
        """Whether a notice went out for the latest quorum: the next one
        must have a new id even with the same members."""
        return bool(self.gone)

    def judge(
        self,
        now: float,
        candidates: Set[str],
        heartbeats: Mapping[str, float],
        streams_closed: Mapping[str, float],
        arrivals: Mapping[str, ArrivalStats],
        config: LighthouseConfig,
    ) -> GoneNotice | None:
        """The notice to send now (judge_gone over the members among
        `candidates` not judged gone yet: the others are known live), or
        None when no member is newly gone. Picked by set operations, so a
        tick after thousands of deaths costs no Python loop over them."""
        if self.quorum_id is None:
            return None
        members = (candidates & self._member_set) - self.gone.keys()
        judged = judge_gone(now, members, heartbeats, streams_closed, arrivals, config)
        return self.judged(judged)

    def judged(self, judged: Mapping[str, str]) -> GoneNotice | None:
        """The notice to send now that `judged` (member -> why) is known to
        be gone, or None when no new member is gone."""
        if self.quorum_id is None:
            return None
        new = {rid: why for rid, why in judged.items() if rid in self._member_set}
        if new.keys() <= self.gone.keys():
            return None
        self.gone.update(new)
        live = tuple(sorted(rid for rid in self.members if rid not in self.gone))
        return GoneNotice(self.quorum_id, tuple(sorted(self.gone)), live) if live else None

    def heard_from(self, replica_id: str) -> GoneNotice | None:
        """A heartbeat of `replica_id`: a notice to it if it is a gone member
        not yet told of every member gone (it came back, e.g. SIGCONT)."""
        if self.quorum_id is None or replica_id not in self.gone:
            return None
        if self._told_back.get(replica_id) == len(self.gone):
            return None
        self._told_back[replica_id] = len(self.gone)
        return GoneNotice(self.quorum_id, tuple(sorted(self.gone)), (replica_id,))

    def describe(self, notice: GoneNotice) -> str:
        """The log line of a notice: who is gone and why, and whom it tells,
        each list cut at LOG_NAMES names (at 10,000 groups a full line
        would be hundreds of KB per death)."""
        why = _some(f"{rid}: {self.gone.get(rid, '?')}" for rid in notice.gone)
        return (
            f"quorum {notice.quorum_id}: members gone ({'; '.join(why)}); telling "
            f"{', '.join(_some(notice.recipients))} to abort the collectives they share with them"
        )


LOG_NAMES = 16
"""The most names a log line lists (GoneWatch.describe)."""


def _some(names: Iterable[str]) -> list[str]:
    listed = list(names)
    if len(listed) <= LOG_NAMES:
        return listed
    return listed[:LOG_NAMES] + [f"and {len(listed) - LOG_NAMES} more"]
