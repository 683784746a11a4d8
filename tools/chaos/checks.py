"""The chaos runner's verdicts, computed from the groups' per-step JSON logs:
step monotonicity, final-state agreement, goodput, and per-fault stall and
rejoin times. Pure: records in, numbers and problem strings out."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    group: int
    incarnation: int
    """How many times this group's training processes had started before
    (0 for the first start): steps restart from 0 in a new incarnation."""
    t: float
    step: int
    committed: bool
    participants: int
    quorum_id: int = -1
    """The quorum the step ran in (-1: unknown, a log without it). Ids grow
    over the job, also across lighthouse restarts."""


def step_regressions(records: list[StepRecord]) -> list[str]:
    """Each incarnation's step never decreases (records in log order)."""
    problems = []
    last: dict[tuple[int, int], StepRecord] = {}
    for r in records:
        prev = last.get((r.group, r.incarnation))
        if prev is not None and r.step < prev.step:
            problems.append(
                f"group {r.group} went back from step {prev.step} to {r.step} "
                f"(incarnation {r.incarnation}, t={r.t:.3f})"
            )
        last[(r.group, r.incarnation)] = r
    return problems


def committed_step_regressions(records: list[StepRecord], slack: int = 1) -> list[str]:
    """The job's highest committed step never goes backwards: every commit
    lands at most `slack` below the highest one committed before it (a member
    of the same quorum may log its commit of step N after another member
    logged N+1).

    "Before" is the order of commitment, not of logging: quorums in id order,
    then log time within a quorum. A group stopped (SIGSTOP) between its
    allreduce and its log line logs that commit seconds late, after the others
    moved on in a later quorum without it; by log time alone its step would
    seem to go back. Within one quorum no member can run ahead by more than a
    step: the next step's allreduce needs them all."""
    problems = []
    highest = 0
    for r in sorted(records, key=lambda r: (r.quorum_id, r.t)):
        if not r.committed:
            continue
        if r.step < highest - slack:
            problems.append(
                f"group {r.group} committed step {r.step} in quorum {r.quorum_id} after "
                f"step {highest} had been committed (t={r.t:.3f})"
            )
        highest = max(highest, r.step)
    return problems


def final_agreement(finals: dict[int, dict]) -> tuple[list[int], list[str]]:
    """Groups that finished in the same (largest) last quorum must hold the
    same state hash at the same step. Returns (groups outside that quorum,
    problems). A group outside it trained its last steps without the others,
    so its state may differ legitimately."""
    by_quorum: dict[int, list[int]] = defaultdict(list)
    for group, final in sorted(finals.items()):
        by_quorum[final.get("quorum_id", -1)].append(group)
    if not by_quorum:
        return [], ["no group finished"]
    main = max(by_quorum.values(), key=len)
    outside = sorted(g for g in finals if g not in main)
    problems = []
    hashes = {g: finals[g]["hash"] for g in main}
    steps = {g: finals[g]["step"] for g in main}
    if len(set(hashes.values())) != 1 or len(set(steps.values())) != 1:
        problems.append(f"groups of the final quorum diverged: steps {steps}, hashes {hashes}")
    return outside, problems


@dataclass(frozen=True)
class Goodput:
    participant_steps: int
    """Sum over committed steps of the groups that committed them."""
    participation: float
    """participant_steps / (num_steps * num_groups): the share of group-steps kept."""
    fault_free_step_s: float
    """Median time between commits while every group took part."""
    goodput: float
    """participant_steps / what num_groups fault-free groups commit in the same time."""


def goodput(records: list[StepRecord], num_groups: int, num_steps: int) -> Goodput:
    participants: dict[int, int] = {}
    for r in records:
        if r.committed:
            participants[r.step] = max(participants.get(r.step, 0), r.participants)
    total = sum(participants.values())
    by_group: dict[int, list[StepRecord]] = defaultdict(list)
    for r in records:
        if r.committed:
            by_group[r.group].append(r)
    full = [
        b.t - a.t
        for rs in by_group.values()
        for a, b in zip(rs, rs[1:])
        if b.step == a.step + 1 and a.participants == b.participants == num_groups
    ]
    step_s = statistics.median(full) if full else float("nan")
    times = [r.t for r in records if r.committed]
    span = max(times) - min(times) if len(times) > 1 else 0.0
    # The first commit ends a step, so the span holds one step less than it seems.
    possible = num_groups * (span / step_s + 1) if full and span else float("nan")
    return Goodput(
        participant_steps=total,
        participation=total / (num_steps * num_groups) if num_steps and num_groups else 0.0,
        fault_free_step_s=step_s,
        goodput=total / possible if possible == possible and possible else float("nan"),
    )


def survivor_stall_s(
    records: list[StepRecord], survivors: list[int], start: float, end: float
) -> float:
    """Longest gap between consecutive commits of any survivor around
    [start, end]: from its last commit before `start` to its first after
    `end`. It includes one ordinary step."""
    worst = 0.0
    for group in survivors:
        times = sorted(r.t for r in records if r.group == group and r.committed)
        before = [t for t in times if t <= start]
        after = [t for t in times if t > end]
        window = ([before[-1]] if before else []) + [t for t in times if start < t <= end]
        window += after[:1]
        gaps = [b - a for a, b in zip(window, window[1:])]
        worst = max([worst, *gaps])
    return worst


def first_commit_after(records: list[StepRecord], groups: list[int], since: float) -> float | None:
    """Time of the first commit by any of `groups` after `since`, or None."""
    times = [r.t for r in records if r.group in groups and r.committed and r.t > since]
    return min(times) if times else None


@dataclass(frozen=True)
class BatchRecord:
    """One participant's batch of one step, logged whether or not its own
    group committed (a peer's commit may have trained it)."""

    group: int
    step: int
    """The step trained: committed steps before it."""
    quorum_id: int
    committed: bool
    """Whether this group committed the step."""
    rank: int
    """Its participating rank."""
    participants: int
    cursor: int
    """Units of data committed before the step (Manager.batches_committed)."""
    unit: int
    """The unit of data it trained."""
    epoch: int
    sample_ids: tuple[int, ...]
    """Rank 0's samples of the unit."""


def data_exactly_once(batches: list[BatchRecord]) -> list[str]:
    """Every unit of data trained in exactly one step of the final history.

    A step (its step number and quorum id) is in the history when a group
    committed it; of a step committed in two quorums (the first committer
    died before anyone healed from it) the later one. Each such step trains
    units [cursor, cursor + participants), participant r unit cursor + r,
    and each starts where the previous ended: no unit skipped, none twice,
    so no sample of an epoch skipped or trained twice. A sample seen twice
    in one epoch is reported too."""
    problems: list[str] = []
    rounds: dict[tuple[int, int], list[BatchRecord]] = {}
    for b in batches:
        rounds.setdefault((b.step, b.quorum_id), []).append(b)
    history: dict[int, list[BatchRecord]] = {}
    for (step, _quorum_id), records in sorted(rounds.items()):
        if any(r.committed for r in records):
            history[step] = records  # a later quorum id replaces an earlier one
    end: int | None = None
    seen: dict[tuple[int, int], int] = {}
    for step, records in sorted(history.items()):
        first = records[0]
        if any((r.cursor, r.participants) != (first.cursor, first.participants) for r in records):
            problems.append(f"step {step}: groups disagree on the cursor or the participants")
            continue
        if end is not None and first.cursor != end:
            what = "never trained" if first.cursor > end else "trained twice"
            lo, hi = sorted((end, first.cursor))
            problems.append(f"step {step} began at unit {first.cursor}: units {lo}-{hi - 1} {what}")
        end = first.cursor + first.participants
        for r in records:
            if r.unit != r.cursor + r.rank:
                problems.append(
                    f"group {r.group} trained unit {r.unit} at step {step}, but as participant "
                    f"{r.rank} the quorum gave it unit {r.cursor + r.rank}"
                )
            for sample in r.sample_ids:
                before = seen.setdefault((r.epoch, sample), step)
                if before != step:
                    problems.append(
                        f"sample {sample} trained at steps {before} and {step} of epoch {r.epoch}"
                    )
                    break
    return problems


def units_trained(batches: list[BatchRecord]) -> int:
    """Units of data the final history trained (the highest cursor reached)."""
    ends = [b.cursor + b.participants for b in batches if b.committed]
    return max(ends, default=0)


@dataclass(frozen=True)
class Suspicion:
    """The lighthouse left a group out of a quorum as hung (phi accrual)."""

    at: float
    """Wall-clock seconds of the quorum that left it out."""
    group: int


@dataclass(frozen=True)
class FaultWindow:
    """From a fault's firing to its settling: when its victim may look hung."""

    group: int
    start: float
    end: float


def false_suspicions(
    suspicions: list[Suspicion], faults: list[FaultWindow], margin_s: float = 1.0
) -> list[str]:
    """Healthy groups the lighthouse took for hung: every suspicion must fall
    within (`margin_s` around) a fault of the suspected group (a SIGSTOP, or a
    kill whose process the lighthouse has not yet seen go)."""
    problems = []
    for s in suspicions:
        if not any(
            f.group == s.group and f.start - margin_s <= s.at <= f.end + margin_s for f in faults
        ):
            problems.append(
                f"group {s.group} was left out as hung at {s.at:.1f} with no fault on it: "
                "a false suspicion"
            )
    return problems
