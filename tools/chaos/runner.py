"""The chaos loop: reads group logs, fires each fault when due, follows it until healed.

Also restarts what died unprovoked, flags what hung, and decides when every
group stops, so that all of them end at the same step.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tools.chaos import checks
from tools.chaos.children import Children, Group
from tools.chaos.schedule import RANK_KINDS, Fault, FaultKind
from tools.procs import free_port, signal_tree, tree

logger = logging.getLogger(__name__)

RECONFIGURING = re.compile(r"reconfiguring for quorum (\d+): replica rank \d+ of \d+")
"""The Manager's line (INFO, every rank) as it sets up the process group of a new quorum."""
HEALING = "healing from replica rank"
"""The Manager's line (healing.receive_state) as a group starts fetching the live state."""
RECONFIGURE_WAIT_S = 2.0
"""KILL_IN_RECONFIGURE kills its second group this long after the first when
no survivor has logged the reconfiguration by then."""
HEAL_WAIT_S = 30.0
"""RESTART_LIGHTHOUSE_IN_HEAL kills the lighthouse this long after its
victim's restart when the victim has neither logged its heal nor committed."""
TREE_KILLS = frozenset(
    {FaultKind.KILL_GROUP, FaultKind.KILL_TWO_GROUPS, FaultKind.KILL_IN_RECONFIGURE,
     FaultKind.RESTART_LIGHTHOUSE_IN_HEAL}
)  # fmt: skip
"""Kinds that SIGKILL whole group trees; the runner restarts each victim."""


@dataclass
class _Active:
    """A fired fault the runner is still following."""

    fault: Fault
    index: int
    fired_at: float
    incarnations: dict[int, int] = field(default_factory=dict)
    """Each victim's incarnation when fired: a rank kill settles only on a
    commit by a later one (a step in flight at the kill may still commit)."""
    survivors: tuple[int, ...] = ()
    """Groups healthy at the fault, other than the victims: their stall counts."""
    recovered_at: float | None = None
    """When every victim could work again: restarts, SIGCONT, lighthouse back."""
    settled_at: float | None = None
    note: str = ""
    killed_at: dict[int, float] = field(default_factory=dict)
    """Victim group -> when its tree was SIGKILLed (the tree kinds)."""
    watch: dict[int, int] = field(default_factory=dict)
    """Group -> offset in its text log (group<i>.log) from which the runner
    looks for the line that triggers the fault's second blow."""
    quorum_before: int = -1
    """KILL_IN_RECONFIGURE: the survivors' latest quorum id at the first kill."""
    lighthouse_killed_at: float | None = None

    def triggered(self) -> bool:
        """The second blow of a two-step kind has been struck (or there is none)."""
        if self.fault.kind == FaultKind.KILL_IN_RECONFIGURE:
            return self.fault.second_group in self.killed_at
        if self.fault.kind == FaultKind.RESTART_LIGHTHOUSE_IN_HEAL:
            return self.lighthouse_killed_at is not None
        return True


@dataclass
class Outcome:
    """What became of one scheduled fault; the report fills the two timings."""

    index: int
    fault: Fault
    fired_at: float | None = None
    incarnations: dict[int, int] = field(default_factory=dict)
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
        self.kill_groups([group])

    def kill_groups(self, groups: list[Group]) -> None:
        """SIGKILLs the groups' trees at once (one signal round), then waits."""
        for group, alive in zip(groups, self.children.kill_groups(groups)):
            if alive:
                self.problems.append(
                    f"group {group.index}: {len(alive)} processes survived SIGKILL"
                )

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
        if any(g.index in a.fault.groups for a in self.active):
            return False
        return checks.first_commit_after(self.records, [g.index], g.launched_at) is not None

    def can_fire(self, fault: Fault) -> bool:
        """Faults overlap, but a group fault needs the lighthouse up, its
        victims healthy and another healthy group (a survivor); a lighthouse
        fault needs every group healthy (a group starting without a
        lighthouse exits), and nothing fires while one is being followed."""
        if self.children.lighthouse_down():
            return False
        if any(a.fault.hits_lighthouse for a in self.active):
            return False
        healthy = [g.index for g in self.groups if self.healthy(g)]
        if fault.hits_lighthouse:
            return len(healthy) == len(self.groups)
        return all(v in healthy for v in fault.groups) and len(healthy) > len(fault.groups)

    def fire(self, fault: Fault, index: int) -> None:
        now = time.time()
        victims = [self.groups[g] for g in fault.groups]
        survivors = tuple(
            g.index for g in self.groups if g.index not in fault.groups and self.healthy(g)
        )
        incarnations = {v.index: v.incarnation for v in victims}
        act = _Active(fault, index, now, incarnations, survivors)
        self.active.append(act)
        logger.info("fault %d at step %d: %s", index, self.leading_step(), fault)
        if fault.kind in (FaultKind.KILL_GROUP, FaultKind.KILL_TWO_GROUPS):
            self.kill_groups(victims)
            for v in victims:
                act.killed_at[v.index], v.restart_at = now, now + fault.delay_s
        elif fault.kind in (FaultKind.KILL_IN_RECONFIGURE, FaultKind.RESTART_LIGHTHOUSE_IN_HEAL):
            first = victims[0]
            if fault.kind == FaultKind.KILL_IN_RECONFIGURE:
                # Whoever is left logs the quorum without the first victim;
                # looked for from before the kill, so none can come unseen.
                watched = [g for g in self.groups if g is not first and g.state == "running"]
                act.watch = {g.index: _size(self.children.text_log(g)) for g in watched}
                act.quorum_before = max(
                    (r.quorum_id for r in self.records if r.group != first.index), default=-1
                )
            self.kill_group(first)
            act.killed_at[first.index], first.restart_at = now, now + fault.delay_s
            if fault.kind == FaultKind.RESTART_LIGHTHOUSE_IN_HEAL:
                # Its restart appends to the same file: its heal lines come after this.
                act.watch = {first.index: _size(self.children.text_log(first))}
        elif fault.kind in RANK_KINDS:
            workers = []
            for g, rank in fault.ranks.items():
                assert self.groups[g].proc is not None
                found = self.children.workers_of_rank(self.groups[g], rank)
                if not found:
                    act.note += f"g{g}/r{rank} not found; "
                workers += found
            trees = [p for w in workers for p in tree(w.pid)]
            for p in trees:  # every worker's tree in one round: at once
                _kill(p)
            act.recovered_at = now  # torchrun restarts its workers, or dies (poll_groups)
        elif fault.kind == FaultKind.STOP_GROUP:
            victim = victims[0]
            assert victim.proc is not None
            self.children.track()
            signal_tree(victim.proc.pid, signal.SIGSTOP)
            victim.state = "stopped"
        elif fault.kind == FaultKind.RESTART_LIGHTHOUSE:
            self.children.kill_lighthouse()
            act.lighthouse_killed_at = now

    def trigger(self, act: _Active) -> None:
        """Strikes a two-step fault's second blow once its trigger line is in
        the watched logs, or once the bounded wait for it is over."""
        if act.triggered():
            return
        f, now = act.fault, time.time()
        if f.kind == FaultKind.KILL_IN_RECONFIGURE:
            assert f.second_group is not None
            seen = self._watch(act, lambda line: _reconfigured_past(line, act.quorum_before))
            waited = now - act.fired_at
            if seen is None and waited < RECONFIGURE_WAIT_S:
                return
            second = self.groups[f.second_group]
            act.note += f"g{second.index} killed {waited:.2f} s after g{f.group}, " + (
                f"at {seen}; " if seen is not None else "no reconfigure line (bounded wait); "
            )
            logger.info("fault %d: killing group %d: %s", act.index, second.index, act.note)
            if second.state == "running" and second.proc is not None:
                self.kill_group(second)
            else:
                act.note += f"g{second.index} was {second.state}; "
            act.killed_at[second.index], second.restart_at = now, now + f.delay_s
        elif f.kind == FaultKind.RESTART_LIGHTHOUSE_IN_HEAL:
            assert f.group is not None
            victim = self.groups[f.group]
            if victim.state != "running" or victim.launched_at < act.killed_at[f.group]:
                return  # not restarted yet
            healing = self._watch(act, lambda line: HEALING if HEALING in line else None)
            committed = checks.first_commit_after(self.records, [f.group], victim.launched_at)
            if healing is None and committed is None and now - victim.launched_at < HEAL_WAIT_S:
                return
            self.children.kill_lighthouse()
            act.lighthouse_killed_at = time.time()
            since = now - victim.launched_at
            act.note += (
                f"lighthouse killed {since:.2f} s after the restart, "
                + ("as it healed; " if healing is not None
                   else "after it committed (heal line missed); " if committed is not None
                   else "no heal line (bounded wait); ")
            )  # fmt: skip
            logger.info("fault %d: %s", act.index, act.note)

    def _watch(self, act: _Active, match: Callable[[str], str | None]) -> str | None:
        """What `match` quotes of the first new line of the watched text logs
        it matches (`g1: ...`), or None."""
        for g, offset in act.watch.items():
            lines, act.watch[g] = _new_lines(self.children.text_log(self.groups[g]), offset)
            for line in lines:
                quote = match(line)
                if quote is not None:
                    return f"g{g}: {quote}"
        return None

    def advance(self, act: _Active) -> bool:
        """Moves a fault on (second blow, SIGCONT, lighthouse restart); True
        once settled: every victim (every group, for the lighthouse) committed
        again."""
        f, now = act.fault, time.time()
        self.trigger(act)
        victim = self.groups[f.group] if f.group is not None else None
        if act.recovered_at is None and f.kind == FaultKind.STOP_GROUP:
            if now >= act.fired_at + f.delay_s:
                assert victim is not None and victim.proc is not None
                signal_tree(victim.proc.pid, signal.SIGCONT)
                victim.state = "running"
                victim.progress_at = act.recovered_at = now
        elif act.recovered_at is None and act.lighthouse_killed_at is not None:
            if now >= act.lighthouse_killed_at + f.delay_s:
                self.children.start_lighthouse()
                act.recovered_at = time.time()
        elif act.recovered_at is None and f.kind in TREE_KILLS and act.triggered():
            if f.kind != FaultKind.RESTART_LIGHTHOUSE_IN_HEAL:
                relaunched = [
                    self.groups[g].launched_at
                    for g in f.groups
                    if self.groups[g].state == "running"
                    and self.groups[g].launched_at >= act.killed_at[g]
                ]
                if len(relaunched) == len(f.groups):
                    act.recovered_at = max(relaunched)
        if act.recovered_at is not None:
            who = list(f.groups) if not f.hits_lighthouse else [g.index for g in self.groups]
            fresh = self.records
            if f.kind in RANK_KINDS:
                fresh = [
                    r for r in self.records
                    if r.group not in act.incarnations or r.incarnation > act.incarnations[r.group]
                ]  # fmt: skip
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
                        (a for a in self.active if g.index in a.fault.groups
                         and a.fault.kind in RANK_KINDS | TREE_KILLS),
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
        lighthouse_fault = any(a.lighthouse_killed_at is not None for a in self.active)
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
            self.pause(0.1)

    def pause(self, seconds: float) -> None:
        """Sleeps, but while a fault waits for its trigger line looks for it
        every 20 ms, so the second blow lands within a few ms of the line."""
        end = time.time() + seconds
        while (left := end - time.time()) > 0:
            waiting = [a for a in self.active if not a.triggered()]
            if not waiting:
                time.sleep(left)
                return
            for a in waiting:
                self.trigger(a)
            time.sleep(min(0.02, max(left, 0)))


def _outcome(act: _Active, settled_at: float | None) -> Outcome:
    return Outcome(
        index=act.index,
        fault=act.fault,
        fired_at=act.fired_at,
        incarnations=act.incarnations,
        survivors=act.survivors,
        recovered_at=act.recovered_at,
        settled_at=settled_at,
        note=act.note,
    )


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The whole lines written to `path` since `offset`, and the new offset."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # a line being written stays for the next look
    return data[:end].decode(errors="replace").splitlines(), offset + end


def _reconfigured_past(line: str, quorum_id: int) -> str | None:
    """`reconfiguring for quorum N` when the line is a Manager's reconfigure
    line for a quorum N later than `quorum_id`, else None."""
    m = RECONFIGURING.search(line)
    return m.group(0) if m is not None and int(m.group(1)) > quorum_id else None


def _kill(p: psutil.Process) -> None:
    try:
        p.send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        pass


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
