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

Pure: times are passed in. Memory is bounded: MAX_GROUPS groups with
MAX_RECENT commit times each, and chart points (MAX_POINTS, halved in
resolution when full, so the whole run stays) for the first MAX_CHARTED
groups only. Each observation costs O(1): a job of thousands of groups pays
about a microsecond per Quorum call.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

MAX_GROUPS = 16384
"""Groups tracked; the one heard from least recently is dropped beyond.
Above the 10,000 groups one lighthouse serves (docs/fleet.md): past it,
groups asking in turn would each drop the next, and every observation
would start a group over."""
MAX_POINTS = 240
"""Chart points per group; when full, every other one is dropped."""
MAX_CHARTED = 16
"""Groups with chart points (the first seen; the chart draws as many)."""
MAX_RECENT = 64
"""Commit times kept per group for its step rate (~2 KB a group)."""
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
    first_seen: float = 0.0
    """Monotonic seconds of the first observation."""
    points: list[tuple[float, int]] | None = None
    """(wall-clock seconds, step) for the chart, thinned when full; None: not charted."""
    commits: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_RECENT))
    """Monotonic seconds of its latest commits, for its step rate."""


def add_point(points: list[tuple[float, int]], point: tuple[float, int], limit: int) -> None:
    """Appends; a full list first drops every other point but the newest two,
    so it spans the whole run at half the resolution."""
    if len(points) >= limit:
        points[:] = points[:-2:2] + points[-2:]
    points.append(point)


def step_rate(commits: deque[float], first_seen: float, now: float, window_s: float) -> float:
    """Commits per second over the last `window_s` (or since `first_seen`, if
    later). When `commits` is full (a fast group), over the span it holds."""
    while commits and commits[0] < now - window_s:
        commits.popleft()
    if not commits:
        return 0.0
    count, start = len(commits), max(now - window_s, first_seen)
    if count == commits.maxlen:
        count, start = count - 1, commits[0]
    span = now - start
    return count / span if span > 0 else 0.0


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
        self.top_step = 0
        self.num_charted = 0
        """The furthest step any group reported."""
        self.committed_total = 0
        """Commits of every group, also of groups dropped beyond MAX_GROUPS."""

    def observe(self, name: str, step: int, wall: float, now: float) -> None:
        """Group `name` asked for a quorum at `step` (wall and monotonic seconds)."""
        if self.job_first_step is None:
            self.job_first_step = self.top_step = step
        group = self.groups.get(name)
        if group is None:
            charted = self.num_charted < MAX_CHARTED
            self.num_charted += charted
            group = GroupProgress(
                base_step=max(self.top_step, step),
                last_step=step,
                last_seen=now,
                first_seen=now,
                points=[] if charted else None,
            )
            self.groups[name] = group
            if len(self.groups) > MAX_GROUPS:
                _, dropped = self.groups.popitem(last=False)
                self.num_charted -= dropped.points is not None
        else:
            self.groups.move_to_end(name)
        if step == group.last_step + 1:
            group.committed += 1
            self.committed_total += 1
            group.commits.append(now)
        group.last_step = step
        group.last_seen = now
        self.top_step = max(self.top_step, step)
        points = group.points
        if points is not None and (not points or points[-1][1] != step):
            add_point(points, (wall, step), MAX_POINTS)

    def on_quorum(self, num_members: int) -> None:
        self.max_groups_in_quorum = max(self.max_groups_in_quorum, num_members)

    def steps_advanced(self) -> int:
        if self.job_first_step is None:
            return 0
        return self.top_step - self.job_first_step

    def job_goodput(self) -> float | None:
        return goodput(self.committed_total, self.max_groups_in_quorum, self.steps_advanced())

    def group_goodput(self, name: str) -> float | None:
        """The group's commits / the steps the job advanced since it was first seen."""
        group = self.groups[name]
        return goodput(group.committed, 1, self.top_step - group.base_step)
