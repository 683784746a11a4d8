"""The chaos loop: reads group logs, fires each fault when due, follows it until healed.

Also restarts what died unprovoked, flags what hung, and decides when every
group stops, so that all of them end at the same step.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.chaos import checks
from tools.chaos.children import Children, Group
from tools.chaos.schedule import Fault, FaultKind
from tools.procs import free_port, signal_tree

logger = logging.getLogger(__name__)


@dataclass
class _Active:
    """A fired fault the runner is still following."""

    fault: Fault
    index: int
    fired_at: float
    incarnation: int = 0
    """The victim's incarnation when fired: a KILL_RANK settles only on a
    commit by a later one (a step in flight at the kill may still commit)."""
    survivors: tuple[int, ...] = ()
    """Groups healthy at the fault, other than the victim: their stall counts."""
    recovered_at: float | None = None
    """When the victim could work again: restart, SIGCONT, lighthouse back."""
    settled_at: float | None = None
    note: str = ""


@dataclass
class Outcome:
    """What became of one scheduled fault; the report fills the two timings."""

    index: int
    fault: Fault
    fired_at: float | None = None
    incarnation: int = 0
    survivors: tuple[int, ...] = ()
    recovered_at: float | None = None
    settled_at: float | None = None
    note: str = ""
    stall_s: float | None = None
    rejoin_s: float | None = None


@dataclass
class Runner:
    """One chaos run: the groups, what their logs said, and the faults' fates."""

    args: argparse.Namespace
    out: Path
    schedule: list[Fault]
    children: Children
    groups: list[Group] = field(default_factory=list)
    records: list[checks.StepRecord] = field(default_factory=list)
    batches: list[checks.BatchRecord] = field(default_factory=list)
    """The samples of each contributed commit (scripts that log sample_ids)."""
    problems: list[str] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    active: list[_Active] = field(default_factory=list)
    next_fault: int = 0
    stop_step: int = 0
    """The step every group was asked to stop at (0: not yet)."""
    unhealthy_since: float = 0.0
    due_since: float = 0.0
    """When the next fault's step was reached while it could not fire yet."""

    def kill_group(self, group: Group) -> None:
        alive = self.children.kill_group(group)
        if alive:
            self.problems.append(f"group {group.index}: {len(alive)} processes survived SIGKILL")

    # ---- logs ----------------------------------------------------------------

    def read_logs(self) -> None:
        for g in self.groups:
            if not g.log.exists():
                continue
            with open(g.log, "rb") as f:
                f.seek(g.offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line cut by SIGKILL stays unread
            g.offset += end
            for line in data[:end].decode(errors="replace").splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                g.progress_at = max(g.progress_at, time.time())
                if r["event"] == "start":
                    g.incarnation += 1
                    g.started = True
                elif r["event"] == "step":
                    self.records.append(
                        checks.StepRecord(
                            g.index, g.incarnation, r["t"], r["step"], r["committed"],
                            r["participants"], r.get("quorum_id", -1),
                        )
                    )  # fmt: skip
                    if r.get("participating_rank") is not None and "data_unit" in r:
                        self.batches.append(batch_record(g.index, r))
                elif r["event"] == "final":
                    g.final = r

    def leading_step(self) -> int:
        return max((r.step for r in self.records if r.committed), default=0)

    # ---- faults --------------------------------------------------------------

    def healthy(self, g: Group) -> bool:
        """Runs, is not a fault's victim, and has committed since its launch."""
        if g.state != "running" or not g.started:
            return False
        if any(a.fault.group == g.index for a in self.active):
            return False
        return checks.first_commit_after(self.records, [g.index], g.launched_at) is not None

    def can_fire(self, fault: Fault) -> bool:
        """Faults overlap, but a group fault needs the lighthouse up and
        another healthy group (a survivor); a lighthouse fault needs every
        group healthy (a group starting without a lighthouse exits)."""
        if self.children.lighthouse_down():
            return False
        if any(a.fault.kind == FaultKind.RESTART_LIGHTHOUSE for a in self.active):
            return False
        healthy = [g.index for g in self.groups if self.healthy(g)]
        if fault.group is None:
            return len(healthy) == len(self.groups)
        return fault.group in healthy and len(healthy) >= 2

    def fire(self, fault: Fault, index: int) -> None:
        now = time.time()
        victim = self.groups[fault.group] if fault.group is not None else None
        survivors = tuple(g.index for g in self.groups if g is not victim and self.healthy(g))
        act = _Active(fault, index, now, victim.incarnation if victim else 0, survivors)
        self.active.append(act)
        logger.info("fault %d at step %d: %s", index, self.leading_step(), fault)
        if fault.kind == FaultKind.KILL_GROUP:
            assert victim is not None
            self.kill_group(victim)
            victim.restart_at = now + fault.delay_s
        elif fault.kind == FaultKind.KILL_RANK:
            assert victim is not None and victim.proc is not None and fault.rank is not None
            workers = self.children.workers_of_rank(victim, fault.rank)
            if not workers:
                act.note = f"rank {fault.rank} not found"
            for p in workers:
                signal_tree(p.pid, signal.SIGKILL)
            act.recovered_at = now  # torchrun restarts its workers, or dies (poll_groups)
        elif fault.kind == FaultKind.STOP_GROUP:
            assert victim is not None and victim.proc is not None
            self.children.track()
            signal_tree(victim.proc.pid, signal.SIGSTOP)
            victim.state = "stopped"
        elif fault.kind == FaultKind.RESTART_LIGHTHOUSE:
            self.children.kill_lighthouse()

    def advance(self, act: _Active) -> bool:
        """Moves a fault on (SIGCONT, lighthouse restart); True once settled:
        the victim (every group, for the lighthouse) committed again."""
        f, now = act.fault, time.time()
        victim = self.groups[f.group] if f.group is not None else None
        if act.recovered_at is None and now >= act.fired_at + f.delay_s:
            if f.kind == FaultKind.STOP_GROUP:
                assert victim is not None and victim.proc is not None
                signal_tree(victim.proc.pid, signal.SIGCONT)
                victim.state = "running"
                victim.progress_at = act.recovered_at = now
            elif f.kind == FaultKind.RESTART_LIGHTHOUSE:
                self.children.start_lighthouse()
                act.recovered_at = time.time()
        if f.kind == FaultKind.KILL_GROUP and act.recovered_at is None and victim is not None:
            if victim.state == "running":
                act.recovered_at = victim.launched_at
        if act.recovered_at is not None:
            who = [victim.index] if victim is not None else [g.index for g in self.groups]
            min_inc = act.incarnation + 1 if f.kind == FaultKind.KILL_RANK else -1
            fresh = [r for r in self.records if r.incarnation >= min_inc or r.group not in who]
            if all(checks.first_commit_after(fresh, [g], act.recovered_at) for g in who):
                act.settled_at = now
        if act.settled_at is None and now - act.fired_at > self.args.settle_timeout_s:
            act.note = act.note or "did not settle"
            self.problems.append(
                f"fault {act.index} ({f.kind.value}) did not settle within "
                f"{self.args.settle_timeout_s:.0f} s"
            )
            act.settled_at = float("nan")
        if act.settled_at is None:
            return False
        self.outcomes.append(_outcome(act, act.settled_at))
        return True

    # ---- the loop --------------------------------------------------------------

    def poll_groups(self) -> None:
        now = time.time()
        for g in self.groups:
            if g.state in ("running", "stopped") and g.proc is not None:
                rc = g.proc.poll()
                if rc == 0:
                    g.state, g.finished_at = "finished", now
                elif rc is not None:
                    cause = next(
                        (a for a in self.active if a.fault.group == g.index
                         and a.fault.kind in (FaultKind.KILL_RANK, FaultKind.KILL_GROUP)),
                        None,
                    )  # fmt: skip
                    if cause is None:
                        self.problems.append(f"group {g.index} exited with {rc} unprovoked")
                    self.kill_group(g)
                    g.restart_at = now + (cause.fault.delay_s if cause else 1.0)
                    logger.info(
                        "group %d: torchrun exited with %d; restarting it in %.1f s",
                        g.index, rc, g.restart_at - now,
                    )  # fmt: skip
            if g.state == "dead" and now >= g.restart_at and not self.stop_step:
                self.children.launch(g)
            if g.state == "running":
                limit = (
                    self.args.quorum_timeout_s + 3 * self.args.timeout_s + 15
                    if g.started
                    else self.args.startup_timeout_s
                )
                if now - g.progress_at > limit:
                    self.problems.append(
                        f"group {g.index} hung: no progress for {now - g.progress_at:.0f} s"
                    )
                    self.kill_group(g)
                    g.restart_at = now + 1.0
        lighthouse_fault = any(a.fault.kind == FaultKind.RESTART_LIGHTHOUSE for a in self.active)
        if self.children.lighthouse is not None and self.children.lighthouse_down():
            if not lighthouse_fault:
                self.problems.append("the lighthouse died unprovoked; restarting it")
                self.children.start_lighthouse()

    def maybe_stop(self) -> None:
        """Once the steps are done, every fault fired and settled and every
        group healthy, asks all groups to stop a few steps later: they are in
        one quorum, so they all stop at the same step."""
        if self.stop_step or self.leading_step() < self.args.steps:
            return
        if self.active or self.next_fault < len(self.schedule):
            return  # each fault is bounded by the settle timeout
        now = time.time()
        if not all(self.healthy(g) for g in self.groups):
            if self.unhealthy_since == 0:
                self.unhealthy_since = now
            if now - self.unhealthy_since <= self.args.settle_timeout_s:
                return
            self.problems.append("not every group was back and healthy at the end")
        self.stop_step = self.leading_step() + 3
        stop_file = self.children.stop_file
        tmp = stop_file.with_suffix(".tmp")
        tmp.write_text(str(self.stop_step))
        tmp.rename(stop_file)
        logger.info("asked every group to stop at step %d", self.stop_step)

    def maybe_fire(self) -> None:
        """Fires the next fault once its step is reached and it can fire; one
        that cannot fire within the settle timeout is a failure and skipped."""
        if self.next_fault >= len(self.schedule) or self.stop_step:
            return
        fault, now = self.schedule[self.next_fault], time.time()
        if self.leading_step() < fault.at_step:
            return
        if self.can_fire(fault):
            self.fire(fault, self.next_fault)
        else:
            if self.due_since == 0:
                self.due_since = now
            if now - self.due_since <= self.args.settle_timeout_s:
                return
            self.problems.append(f"fault {self.next_fault} could not fire: groups not healthy")
            self.outcomes.append(Outcome(self.next_fault, fault, note="could not fire"))
        self.next_fault += 1
        self.due_since = 0.0

    def run(self) -> None:
        self.children.port = free_port()
        self.children.start_lighthouse()
        self.groups = [Group(g, self.out / f"group{g}.jsonl") for g in range(self.args.groups)]
        for g in self.groups:
            self.children.launch(g)
        deadline = time.time() + self.args.timeout
        last_report = 0.0
        while True:
            now = time.time()
            if now > deadline:
                self.problems.append(f"gave up after {self.args.timeout:.0f} s")
                return
            self.read_logs()
            self.children.track()
            self.poll_groups()
            self.active = [a for a in self.active if not self.advance(a)]
            self.maybe_fire()
            self.maybe_stop()
            over = all(g.state in ("finished", "dead") for g in self.groups)
            if over and any(g.state == "finished" for g in self.groups):
                for a in self.active:
                    a.note = "training ended before it settled"
                    self.outcomes.append(_outcome(a, None))
                for i in range(self.next_fault, len(self.schedule)):
                    self.outcomes.append(Outcome(i, self.schedule[i], note="not fired"))
                self.active = []
                return
            if now - last_report > 10:
                last_report = now
                logger.info(
                    "step %d, faults %d/%d, groups %s", self.leading_step(), self.next_fault,
                    len(self.schedule), " ".join(g.state for g in self.groups),
                )  # fmt: skip
            time.sleep(0.1)


def _outcome(act: _Active, settled_at: float | None) -> Outcome:
    return Outcome(
        index=act.index,
        fault=act.fault,
        fired_at=act.fired_at,
        incarnation=act.incarnation,
        survivors=act.survivors,
        recovered_at=act.recovered_at,
        settled_at=settled_at,
        note=act.note,
    )


def batch_record(group: int, r: dict) -> checks.BatchRecord:
    """A participant's step record of examples/train_ddp.py as a BatchRecord."""
    return checks.BatchRecord(
        group=group,
        step=r["step"] - 1 if r["committed"] else r["step"],
        quorum_id=r["quorum_id"],
        committed=r["committed"],
        rank=r["participating_rank"],
        participants=r["participants"],
        cursor=r["data_cursor"],
        unit=r["data_unit"],
        epoch=r["data_epoch"],
        sample_ids=tuple(r["sample_ids"]),
    )
