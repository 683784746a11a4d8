"""Per-group training progress as the lighthouse sees it: committed steps over
time, step rate and goodput.

The lighthouse hears each group's step once per step (its Quorum call), so
that is what it records, by group name (a restarted group continues its own
line). A step counts as committed by a group when its step grew by exactly
one since its previous call; a heal's jump (state copied, not trained) and a
restart's drop count as none.

Goodput, as the page shows it: committed replica-steps / possible ones, where
possible = (the most groups ever in one quorum) x (steps the job advanced
since the lighthouse first heard of it). 1.0 means every group trained every
step; a group that was down, healing or failing to commit lowers it.

Pure: times are passed in. Memory is bounded: MAX_GROUPS groups, MAX_POINTS
chart points each (halved in resolution when full, so the whole run stays).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

MAX_GROUPS = 256
"""Groups tracked; the one heard from least recently is dropped beyond."""
MAX_POINTS = 240
"""Chart points per group; when full, every other one is dropped."""
RATE_WINDOW_S = 30.0
"""Step rates are taken over this many recent seconds."""


@dataclass
class GroupProgress:
    base_step: int
    """The job's furthest step when the group was first seen (or its own, if further)."""
    last_step: int
    last_seen: float
    """Monotonic seconds of the last observation."""
    committed: int = 0
    """Steps committed (grown by exactly one) while the lighthouse watched."""
    points: list[tuple[float, int]] = field(default_factory=list)
    """(wall-clock seconds, step) for the chart, thinned when full."""
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))
    """(monotonic seconds, 1 if that observation was a commit else 0) in the rate window."""


def add_point(points: list[tuple[float, int]], point: tuple[float, int], limit: int) -> None:
    """Appends; a full list first drops every other point but the newest two,
    so it spans the whole run at half the resolution."""
    if len(points) >= limit:
        points[:] = points[:-2:2] + points[-2:]
    points.append(point)


def step_rate(recent: deque[tuple[float, int]], now: float, window_s: float) -> float:
    """Committed steps per second over the last `window_s` (0 with fewer than two observations)."""
    while recent and recent[0][0] < now - window_s:
        recent.popleft()
    if len(recent) < 2:
        return 0.0
    span = now - recent[0][0]
    return sum(c for _, c in list(recent)[1:]) / span if span > 0 else 0.0


def goodput(committed: int, max_groups: int, steps_advanced: int) -> float | None:
    """committed / (max_groups * steps_advanced), at most 1; None before any step."""
    possible = max_groups * steps_advanced
    if possible <= 0:
        return None
    return min(committed / possible, 1.0)


class Progress:
    """What the lighthouse has seen of every group's steps."""

    def __init__(self) -> None:
        self.groups: OrderedDict[str, GroupProgress] = OrderedDict()
        self.max_groups_in_quorum = 0
        self.job_first_step: int | None = None
        self.committed_dropped = 0
        """Commits of groups dropped beyond MAX_GROUPS (still count in goodput)."""

    def observe(self, name: str, step: int, wall: float, now: float) -> None:
        """Group `name` asked for a quorum at `step` (wall and monotonic seconds)."""
        if self.job_first_step is None:
            self.job_first_step = step
        group = self.groups.get(name)
        if group is None:
            base = max([g.last_step for g in self.groups.values()] + [step])
            group = GroupProgress(base_step=base, last_step=step, last_seen=now)
            self.groups[name] = group
            if len(self.groups) > MAX_GROUPS:
                _, dropped = self.groups.popitem(last=False)
                self.committed_dropped += dropped.committed
        else:
            self.groups.move_to_end(name)
        commit = 1 if step == group.last_step + 1 else 0
        group.committed += commit
        group.last_step = step
        group.last_seen = now
        group.recent.append((now, commit))
        if not group.points or group.points[-1][1] != step:
            add_point(group.points, (wall, step), MAX_POINTS)

    def on_quorum(self, num_members: int) -> None:
        self.max_groups_in_quorum = max(self.max_groups_in_quorum, num_members)

    def steps_advanced(self) -> int:
        if self.job_first_step is None or not self.groups:
            return 0
        return max(g.last_step for g in self.groups.values()) - self.job_first_step

    def job_goodput(self) -> float | None:
        committed = self.committed_dropped + sum(g.committed for g in self.groups.values())
        return goodput(committed, self.max_groups_in_quorum, self.steps_advanced())

    def group_goodput(self, name: str) -> float | None:
        """The group's commits / the steps the job advanced since it was first seen."""
        group = self.groups[name]
        top = max(g.last_step for g in self.groups.values())
        return goodput(group.committed, 1, top - group.base_step)
