"""The chaos runner's fault schedule: which fault, on whom, at which step, for
how long. Pure and seeded, so a failing run is replayed by its seed."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum


class FaultKind(str, Enum):
    KILL_GROUP = "kill_group"
    """SIGKILL of a whole group's process tree; restarted after the delay."""
    KILL_RANK = "kill_rank"
    """SIGKILL of one worker; torchrun restarts the group's workers or dies
    (then the runner restarts it after the delay)."""
    STOP_GROUP = "stop_group"
    """SIGSTOP of a group's tree, SIGCONT after the delay: a hang, not a death."""
    RESTART_LIGHTHOUSE = "restart_lighthouse"
    """SIGKILL of the lighthouse, restarted on the same port after the delay."""
    # Correlated faults: what a rack or a power domain does, several hosts in
    # the same second.
    KILL_TWO_GROUPS = "kill_two_groups"
    """SIGKILL of two groups' trees at once; both restarted after the delay."""
    KILL_IN_RECONFIGURE = "kill_in_reconfigure"
    """SIGKILL of `group`, then of `second_group` as soon as a survivor logs
    that it reconfigures for the quorum without the first (or after a bounded
    wait); each restarted the delay after its own kill."""
    KILL_RANK_PAIR = "kill_rank_pair"
    """SIGKILL of one worker in each of two groups at once; as KILL_RANK for each."""
    RESTART_LIGHTHOUSE_IN_HEAL = "restart_lighthouse_in_heal"
    """A KILL_GROUP of `group`; once its restart logs that it heals, SIGKILL of
    the lighthouse, restarted on the same port after the delay."""


BASIC_KINDS = (
    FaultKind.KILL_GROUP,
    FaultKind.KILL_RANK,
    FaultKind.STOP_GROUP,
    FaultKind.RESTART_LIGHTHOUSE,
)
"""A run's kinds unless it names others."""
CORRELATED_KINDS = (
    FaultKind.KILL_TWO_GROUPS,
    FaultKind.KILL_IN_RECONFIGURE,
    FaultKind.KILL_RANK_PAIR,
    FaultKind.RESTART_LIGHTHOUSE_IN_HEAL,
)
"""Several victims in the same second (`--correlated`)."""
ALL_KINDS = BASIC_KINDS
"""The default kinds (kept under this name for its users)."""
TWO_GROUP_KINDS = frozenset(
    {FaultKind.KILL_TWO_GROUPS, FaultKind.KILL_IN_RECONFIGURE, FaultKind.KILL_RANK_PAIR}
)
"""Kinds that take two groups down: they need a third to survive."""
LIGHTHOUSE_KINDS = frozenset({FaultKind.RESTART_LIGHTHOUSE, FaultKind.RESTART_LIGHTHOUSE_IN_HEAL})
"""Kinds that take the lighthouse down: their stalls are not the survivors' bound."""
RANK_KINDS = frozenset({FaultKind.KILL_RANK, FaultKind.KILL_RANK_PAIR})
"""Kinds that kill workers, not trees: torchrun restarts them or dies."""


@dataclass(frozen=True)
class Fault:
    at_step: int
    """Fired once the furthest group has committed this step (later if the
    previous fault has not settled yet)."""
    kind: FaultKind
    group: int | None
    """Victim replica group (the first of two); None for the lighthouse."""
    rank: int | None
    """Victim rank inside the group, for KILL_RANK and KILL_RANK_PAIR only."""
    delay_s: float
    """Seconds down: before the restart, the SIGCONT or the lighthouse restart."""
    second_group: int | None = None
    """The other victim group of a two-group kind (TWO_GROUP_KINDS)."""
    second_rank: int | None = None
    """Victim rank inside second_group, for KILL_RANK_PAIR only."""

    @property
    def groups(self) -> tuple[int, ...]:
        """Every victim group, the first first."""
        return tuple(g for g in (self.group, self.second_group) if g is not None)

    @property
    def ranks(self) -> dict[int, int]:
        """Victim group -> victim rank, for the rank kinds."""
        pairs = ((self.group, self.rank), (self.second_group, self.second_rank))
        return {g: r for g, r in pairs if g is not None and r is not None}

    @property
    def hits_lighthouse(self) -> bool:
        return self.kind in LIGHTHOUSE_KINDS

    def victims(self) -> str:
        """`g0/r1+g2/r0`, `g1+lighthouse`, `lighthouse`."""
        names = [f"g{g}" + (f"/r{self.ranks[g]}" if g in self.ranks else "") for g in self.groups]
        return "+".join(names + (["lighthouse"] if self.hits_lighthouse else []))


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    num_groups: int
    nproc_per_group: int
    num_steps: int
    num_faults: int
    seed: int
    kinds: tuple[FaultKind, ...] = BASIC_KINDS
    """Kinds to draw from; a kind listed twice comes twice as often. Faults
    cycle through a seeded shuffle of this list, so each listed kind occurs
    (almost) equally often and a list as long as num_faults gives each once."""
    min_delay_s: float = 0.5
    max_delay_s: float = 3.0
    warmup_steps: int = 10
    """No fault before this step: every group has started and joined."""
    tail_steps: int = 20
    """No fault in the last steps, so every victim is back before the end and
    all groups finish in one quorum."""

    def __post_init__(self) -> None:
        positive = ("num_groups", "nproc_per_group", "num_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be at least 1")
        if self.num_faults < 0:
            raise ValueError(f"num_faults ({self.num_faults}) must be 0 or more")
        two = [k.value for k in self.kinds if k in TWO_GROUP_KINDS]
        if self.num_faults and self.num_groups < 3 and two:
            raise ValueError(
                f"num_groups ({self.num_groups}) must be at least 3 for {', '.join(two)}: "
                "two groups go down at once and a third must keep training; add groups "
                "or leave these kinds out"
            )
        if self.num_faults and self.num_groups < 2 and self._needs_survivor():
            raise ValueError(
                f"num_groups ({self.num_groups}) must be at least 2 to fault a group: "
                "a survivor must keep training; add groups or fault only the lighthouse"
            )
        if not self.kinds:
            raise ValueError("kinds is empty; list at least one of " + _names(tuple(FaultKind)))
        if not 0 <= self.min_delay_s <= self.max_delay_s:
            raise ValueError(
                f"delays ({self.min_delay_s}, {self.max_delay_s}) must satisfy "
                "0 <= min_delay_s <= max_delay_s"
            )
        if self.num_faults and self.warmup_steps + self.tail_steps >= self.num_steps:
            raise ValueError(
                f"warmup_steps + tail_steps ({self.warmup_steps} + {self.tail_steps}) must be "
                f"below num_steps ({self.num_steps}) to leave room for faults; train longer"
            )

    def _needs_survivor(self) -> bool:
        return any(k != FaultKind.RESTART_LIGHTHOUSE for k in self.kinds)


def parse_kinds(text: str) -> tuple[FaultKind, ...]:
    """`kill_group,stop_group` -> kinds; ValueError naming the valid ones."""
    kinds = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        try:
            kinds.append(FaultKind(name))
        except ValueError:
            raise ValueError(
                f"unknown fault kind {name!r}; use a comma list of {_names(tuple(FaultKind))}"
            ) from None
    return tuple(kinds)


def make_schedule(config: ScheduleConfig) -> list[Fault]:
    """Faults evenly spread over [warmup_steps, num_steps - tail_steps], each
    step jittered within its slot; kinds, victims and delays drawn from
    `random.Random(seed)`. A KILL_RANK in single-rank groups is a KILL_GROUP,
    a KILL_RANK_PAIR a KILL_TWO_GROUPS. A two-group kind draws two different
    groups (of the three or more it needs: never all). A list of basic kinds
    draws as it did before the correlated kinds came: old seeds replay."""
    rng = random.Random(config.seed)
    first, last = config.warmup_steps, config.num_steps - config.tail_steps
    slot = (last - first) / max(config.num_faults, 1)
    kinds: list[FaultKind] = []
    faults = []
    for i in range(config.num_faults):
        if not kinds:
            kinds = list(config.kinds)
            rng.shuffle(kinds)
        kind = kinds.pop(0)
        at_step = first + int(slot * i + rng.random() * slot)
        delay_s = round(rng.uniform(config.min_delay_s, config.max_delay_s), 3)
        group = rank = second_group = second_rank = None
        if kind in TWO_GROUP_KINDS:
            group, second_group = rng.sample(range(config.num_groups), 2)
            if kind == FaultKind.KILL_RANK_PAIR:
                if config.nproc_per_group == 1:
                    kind = FaultKind.KILL_TWO_GROUPS
                else:
                    rank = rng.randrange(config.nproc_per_group)
                    second_rank = rng.randrange(config.nproc_per_group)
        elif kind != FaultKind.RESTART_LIGHTHOUSE:
            group = rng.randrange(config.num_groups)
        if kind == FaultKind.KILL_RANK:
            if config.nproc_per_group == 1:
                kind = FaultKind.KILL_GROUP
            else:
                rank = rng.randrange(config.nproc_per_group)
        faults.append(Fault(at_step, kind, group, rank, delay_s, second_group, second_rank))
    return faults


def _names(kinds: tuple[FaultKind, ...]) -> str:
    return ", ".join(k.value for k in kinds)
