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


ALL_KINDS = tuple(FaultKind)


@dataclass(frozen=True)
class Fault:
    at_step: int
    """Fired once the furthest group has committed this step (later if the
    previous fault has not settled yet)."""
    kind: FaultKind
    group: int | None
    """Victim replica group; None for the lighthouse."""
    rank: int | None
    """Victim rank inside the group, for KILL_RANK only."""
    delay_s: float
    """Seconds down: before the restart, the SIGCONT or the lighthouse restart."""


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    num_groups: int
    nproc_per_group: int
    num_steps: int
    num_faults: int
    seed: int
    kinds: tuple[FaultKind, ...] = ALL_KINDS
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
        if self.num_faults and self.num_groups < 2 and self._needs_survivor():
            raise ValueError(
                f"num_groups ({self.num_groups}) must be at least 2 to fault a group: "
                "a survivor must keep training; add groups or fault only the lighthouse"
            )
        if not self.kinds:
            raise ValueError("kinds is empty; list at least one of " + _names(ALL_KINDS))
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
                f"unknown fault kind {name!r}; use a comma list of {_names(ALL_KINDS)}"
            ) from None
    return tuple(kinds)


def make_schedule(config: ScheduleConfig) -> list[Fault]:
    """Faults evenly spread over [warmup_steps, num_steps - tail_steps], each
    step jittered within its slot; kinds, victims and delays drawn from
    `random.Random(seed)`. A KILL_RANK in single-rank groups is a KILL_GROUP."""
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
        group = rank = None
        if kind != FaultKind.RESTART_LIGHTHOUSE:
            group = rng.randrange(config.num_groups)
        if kind == FaultKind.KILL_RANK:
            if config.nproc_per_group == 1:
                kind = FaultKind.KILL_GROUP
            else:
                rank = rng.randrange(config.nproc_per_group)
        faults.append(Fault(at_step, kind, group, rank, delay_s))
    return faults


def _names(kinds: tuple[FaultKind, ...]) -> str:
    return ", ".join(k.value for k in kinds)
