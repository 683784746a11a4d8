"""Chaos runner: a lighthouse and replica groups (real torchrun jobs running
examples/train_ddp.py) trained under a seeded schedule of faults, then checked.

    python -m torchft_like.chaos --groups 3 --nproc-per-group 2 --steps 400 --faults 20

Faults (torchft_like._chaos_schedule): SIGKILL of a whole group, SIGKILL of one
rank, SIGSTOP/SIGCONT of a group, SIGKILL and restart of the lighthouse on the
same port. One fault at a time: the next fires once the previous victim has
committed again. At the end it checks (torchft_like._chaos_checks) that the
groups of the last quorum hold bit-identical state, that no step went
backwards, that nothing hung and that every child process is gone, and prints
goodput and a per-fault table of survivor stalls and rejoin times. Exits 1 when
a check fails; Ctrl-C or any error kills every child.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from torchft_like import _chaos_checks as checks
from torchft_like._chaos_schedule import (
    ALL_KINDS,
    Fault,
    FaultKind,
    ScheduleConfig,
    make_schedule,
    parse_kinds,
)
from torchft_like._procs import free_port, kill_tree, signal_tree, spawn, tree

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="torchft_like chaos runner")
    p.add_argument("--groups", type=int, default=3, help="replica groups")
    p.add_argument("--nproc-per-group", type=int, default=2, help="ranks per replica group")
    p.add_argument("--steps", type=int, default=200, help="committed steps to train")
    p.add_argument("--faults", type=int, default=8, help="faults to inject")
    p.add_argument("--kinds", default=",".join(k.value for k in ALL_KINDS),
                   help="comma list of fault kinds, cycled in a seeded order")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the schedule and restart delays")
    p.add_argument("--out", default="demo_out/chaos", help="folder for logs and summary.json")
    p.add_argument("--min-delay-s", type=float, default=0.5, help="shortest down time")
    p.add_argument("--max-delay-s", type=float, default=3.0, help="longest down time")
    p.add_argument("--warmup-steps", type=int, default=10, help="no fault before this step")
    p.add_argument("--tail-steps", type=int, default=5, help="no fault in the last steps")
    p.add_argument("--hidden", type=int, default=32, help="hidden width of the MLP")
    p.add_argument("--step-sleep", type=float, default=0.1, help="seconds each step sleeps")
    p.add_argument("--max-restarts", type=int, default=1,
                   help="torchrun --max-restarts: worker restarts before it dies")  # fmt: skip
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="lighthouse option")
    p.add_argument("--join-timeout-ms", type=int, default=1000, help="lighthouse option")
    p.add_argument("--timeout-s", type=float, default=5, help="collective and vote timeout")
    p.add_argument("--quorum-timeout-s", type=float, default=20, help="one quorum's bound")
    p.add_argument("--settle-timeout-s", type=float, default=90,
                   help="a victim not committing again within this is a failure")  # fmt: skip
    p.add_argument("--startup-timeout-s", type=float, default=90,
                   help="a group not ready within this after launch counts as hung")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    return p


@dataclass
class _Group:
    index: int
    log: Path
    proc: subprocess.Popen | None = None
    state: str = "running"
    """running, stopped (SIGSTOP), dead (waiting for restart_at), finished."""
    restart_at: float = 0.0
    launched_at: float = 0.0
    progress_at: float = 0.0
    """Last sign of life: launch, a log record, or the SIGCONT."""
    incarnation: int = -1
    started: bool = False
    """A start record arrived since the last launch (the Manager is up)."""
    offset: int = 0
    final: dict | None = None
    finished_at: float = 0.0


@dataclass
class _Active:
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
class _Outcome:
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
    args: argparse.Namespace
    out: Path
    schedule: list[Fault]
    groups: list[_Group] = field(default_factory=list)
    records: list[checks.StepRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    outcomes: list[_Outcome] = field(default_factory=list)
    seen: dict[tuple[int, float], psutil.Process] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    lighthouse: subprocess.Popen | None = None
    port: int = 0
    active: list[_Active] = field(default_factory=list)
    next_fault: int = 0
    stop_step: int = 0
    """The step every group was asked to stop at (0: not yet)."""
    unhealthy_since: float = 0.0
    due_since: float = 0.0
    """When the next fault's step was reached while it could not fire yet."""

    @property
    def stop_file(self) -> Path:
        return self.out / "stop_step"

    # ---- processes -----------------------------------------------------------

    def _spawn(self, argv: list[str], log_name: str, env: dict[str, str]) -> subprocess.Popen:
        with open(self.out / log_name, "ab") as log:  # the child keeps its own copy
            proc = spawn(argv, log, env, REPO)
        self.procs.append(proc)
        return proc

    def start_lighthouse(self, wait_s: float = 30) -> None:
        """Starts it on self.port; retries while the port is still held."""
        deadline = time.monotonic() + wait_s
        while True:
            self.lighthouse = self._spawn(
                [sys.executable, "-m", "lighthouse", "--min-replicas", "1",
                 "--bind", f"127.0.0.1:{self.port}", "--http-bind", "",
                 "--heartbeat-timeout-ms", str(self.args.heartbeat_timeout_ms),
                 "--join-timeout-ms", str(self.args.join_timeout_ms)],
                "lighthouse.log", {},
            )  # fmt: skip
            while self.lighthouse.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    return
                except OSError:
                    time.sleep(0.05)
            kill_tree(self.lighthouse.pid)
            self.lighthouse.wait()
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"lighthouse did not start on port {self.port}; see lighthouse.log"
                )
            time.sleep(0.2)

    def launch(self, group: _Group) -> None:
        a = self.args
        group.proc = self._spawn(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node", str(a.nproc_per_group), "--max-restarts", str(a.max_restarts),
             # The runner ends training through --stop-file; --steps only caps it.
             "examples/train_ddp.py", "--steps", str(10 * a.steps + 1000),
             "--stop-file", str(self.stop_file), "--hidden", str(a.hidden),
             "--layers", "2", "--step-sleep", str(a.step_sleep), "--timeout-s", str(a.timeout_s),
             "--log-json", str(group.log)],
            f"group{group.index}.log",
            {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.port}",
             "REPLICA_GROUP_ID": str(group.index), "NUM_REPLICA_GROUPS": str(a.groups),
             "TORCHFT_TIMEOUT_SEC": str(a.timeout_s),
             "TORCHFT_QUORUM_TIMEOUT_SEC": str(a.quorum_timeout_s),
             "TORCHFT_CONNECT_TIMEOUT_SEC": str(a.timeout_s)},
        )  # fmt: skip
        group.state = "running"
        group.started = False
        group.launched_at = group.progress_at = time.time()

    def kill_group(self, group: _Group) -> None:
        assert group.proc is not None
        alive = kill_tree(group.proc.pid)
        if alive:
            self.problems.append(f"group {group.index}: {len(alive)} processes survived SIGKILL")
        group.proc.wait(timeout=10)
        group.state = "dead"

    def track(self) -> None:
        """Remembers every descendant ever seen, to check each is gone at exit."""
        for proc in [self.lighthouse, *(g.proc for g in self.groups)]:
            if proc is not None and proc.poll() is None:
                for p in tree(proc.pid):
                    try:
                        self.seen.setdefault((p.pid, p.create_time()), p)
                    except psutil.NoSuchProcess:
                        pass

    def kill_all(self) -> list[str]:
        """SIGKILLs every child tree; returns those still running after it."""
        self.track()
        for proc in self.procs:
            kill_tree(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        left = []
        for p in self.seen.values():  # an orphan whose parent died first
            try:
                if p.is_running():  # psutil checks the pid was not reused
                    p.kill()
                    p.wait(timeout=5)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired, ChildProcessError):
                pass
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
            except psutil.NoSuchProcess:
                pass
        return left

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
                            r["participants"],
                        )
                    )  # fmt: skip
                elif r["event"] == "final":
                    g.final = r

    def leading_step(self) -> int:
        return max((r.step for r in self.records if r.committed), default=0)

    # ---- faults --------------------------------------------------------------

    def healthy(self, g: _Group) -> bool:
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
        if self.lighthouse is None or self.lighthouse.poll() is not None:
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
            workers = [p for p in tree(victim.proc.pid) if _rank_of(p) == fault.rank]
            if not workers:
                act.note = f"rank {fault.rank} not found"
            for p in workers:
                signal_tree(p.pid, signal.SIGKILL)
            act.recovered_at = now  # torchrun restarts its workers, or dies (poll_groups)
        elif fault.kind == FaultKind.STOP_GROUP:
            assert victim is not None and victim.proc is not None
            self.track()
            signal_tree(victim.proc.pid, signal.SIGSTOP)
            victim.state = "stopped"
        elif fault.kind == FaultKind.RESTART_LIGHTHOUSE:
            assert self.lighthouse is not None
            kill_tree(self.lighthouse.pid)
            self.lighthouse.wait()

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
                self.start_lighthouse()
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
                self.launch(g)
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
        if self.lighthouse is not None and self.lighthouse.poll() is not None:
            if not lighthouse_fault:
                self.problems.append("the lighthouse died unprovoked; restarting it")
                self.start_lighthouse()

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
        tmp = self.stop_file.with_suffix(".tmp")
        tmp.write_text(str(self.stop_step))
        tmp.rename(self.stop_file)
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
            self.outcomes.append(_Outcome(self.next_fault, fault, note="could not fire"))
        self.next_fault += 1
        self.due_since = 0.0

    def run(self) -> None:
        self.port = free_port()
        self.start_lighthouse()
        self.groups = [_Group(g, self.out / f"group{g}.jsonl") for g in range(self.args.groups)]
        for g in self.groups:
            self.launch(g)
        deadline = time.time() + self.args.timeout
        last_report = 0.0
        while True:
            now = time.time()
            if now > deadline:
                self.problems.append(f"gave up after {self.args.timeout:.0f} s")
                return
            self.read_logs()
            self.track()
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
                    self.outcomes.append(_Outcome(i, self.schedule[i], note="not fired"))
                self.active = []
                return
            if now - last_report > 10:
                last_report = now
                logger.info(
                    "step %d, faults %d/%d, groups %s", self.leading_step(), self.next_fault,
                    len(self.schedule), " ".join(g.state for g in self.groups),
                )  # fmt: skip
            time.sleep(0.1)


def _outcome(act: _Active, settled_at: float | None) -> _Outcome:
    return _Outcome(
        index=act.index,
        fault=act.fault,
        fired_at=act.fired_at,
        incarnation=act.incarnation,
        survivors=act.survivors,
        recovered_at=act.recovered_at,
        settled_at=settled_at,
        note=act.note,
    )


def _rank_of(proc: psutil.Process) -> int | None:
    """RANK of a training worker, None for torchrun itself or a helper."""
    try:
        if not any("train_ddp.py" in part for part in proc.cmdline()):
            return None
        rank = proc.environ().get("RANK")
        return int(rank) if rank is not None else None
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


# ---- report ------------------------------------------------------------------


def report(runner: Runner, left: list[str]) -> int:
    a, records = runner.args, runner.records
    problems = list(runner.problems)
    problems += checks.step_regressions(records)
    problems += checks.committed_step_regressions(records)
    finals = {g.index: g.final for g in runner.groups if g.final is not None}
    outside, divergence = checks.final_agreement(finals)
    problems += divergence
    missing = [g.index for g in runner.groups if g.final is None]
    if missing:
        problems.append(f"groups {missing} did not finish")
    if left:
        problems.append(f"processes alive after the cleanup: {left}")
    for g in runner.groups:
        if g.final is not None and g.state != "finished":
            problems.append(f"group {g.index} logged its final step but did not exit")
    for o in runner.outcomes:
        if o.settled_at is None or o.fired_at is None or o.settled_at != o.settled_at:
            continue
        # A survivor hit by a later fault stalls for its own reason from then on.
        stalls = []
        for g in o.survivors:
            hit = min(
                (x.fired_at for x in runner.outcomes
                 if x.fault.group == g and x.fired_at is not None and x.fired_at > o.fired_at),
                default=float("inf"),
            )  # fmt: skip
            before = [r for r in records if r.t < hit]
            stalls.append(checks.survivor_stall_s(before, [g], o.fired_at, min(o.settled_at, hit)))
        o.stall_s = max(stalls, default=None)
        survivors = list(o.survivors)
        who = [o.fault.group] if o.fault.group is not None else survivors
        since = o.recovered_at if o.recovered_at is not None else o.fired_at
        fresh = records
        if o.fault.kind == FaultKind.KILL_RANK:  # a step in flight at the kill may commit
            fresh = [r for r in records if r.group not in who or r.incarnation > o.incarnation]
        first = checks.first_commit_after(fresh, who, since)
        o.rejoin_s = first - since if first is not None else None
    final_step = runner.leading_step()
    gp = checks.goodput(records, a.groups, final_step)

    print("\n fault | step | kind               | victim | down s | survivor stall s | rejoin s |")
    for o in sorted(runner.outcomes, key=lambda o: o.index):
        f = o.fault
        victim = (
            "lighthouse"
            if f.group is None
            else f"g{f.group}" + (f"/r{f.rank}" if f.rank is not None else "")
        )
        print(
            f" {o.index:>5} | {f.at_step:>4} | {f.kind.value:<18} | {victim:>6} "
            f"| {f.delay_s:>6.2f} | {_fmt(o.stall_s):>16} | {_fmt(o.rejoin_s):>8} | {o.note}"
        )
    done = [o for o in runner.outcomes if o.fired_at is not None]
    stalls = [o.stall_s for o in done if o.stall_s is not None]
    rejoins = [o.rejoin_s for o in done if o.rejoin_s is not None]
    print(f"\nfaults injected: {len(done)} of {len(runner.schedule)} scheduled (seed {a.seed})")
    print(f"survivor stall s: median {_med(stalls)}, worst {_fmt(max(stalls, default=None))}")
    print(f"rejoin s:         median {_med(rejoins)}, worst {_fmt(max(rejoins, default=None))}")
    for kind in FaultKind:
        of_kind = [o for o in done if o.fault.kind == kind]
        if of_kind:
            st = [o.stall_s for o in of_kind if o.stall_s is not None]
            rj = [o.rejoin_s for o in of_kind if o.rejoin_s is not None]
            print(
                f"  {kind.value:<18} x{len(of_kind):<3} stall median {_med(st)} worst "
                f"{_fmt(max(st, default=None))}, rejoin median {_med(rj)} worst "
                f"{_fmt(max(rj, default=None))}"
            )
    print(
        f"goodput {gp.goodput:.1%} ({gp.participant_steps} group-steps committed; fault-free "
        f"step {gp.fault_free_step_s:.3f} s); participation {gp.participation:.1%} of "
        f"{final_step} steps x {a.groups} groups"
    )
    for g in runner.groups:
        f = g.final
        print(f"group {g.index}: " + (f"step {f['step']} hash {f['hash']} quorum {f['quorum_id']}"
                                      if f else "no final state"))  # fmt: skip
    if outside:
        print(f"groups {outside} ended outside the last quorum (trained alone at the end)")
    print("\nCHECKS PASSED" if not problems else "\nCHECKS FAILED:\n  " + "\n  ".join(problems))
    summary = {
        "args": vars(a),
        "faults": [
            {**asdict(o), "fault": {**asdict(o.fault), "kind": o.fault.kind.value}}
            for o in runner.outcomes
        ],
        "goodput": asdict(gp),
        "finals": finals,
        "outside_last_quorum": outside,
        "problems": problems,
        "stall_median_s": statistics.median(stalls) if stalls else None,
        "rejoin_median_s": statistics.median(rejoins) if rejoins else None,
    }
    (runner.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"logs and summary.json in {runner.out}")
    return 0 if not problems else 1


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _med(xs: list[float]) -> str:
    return _fmt(statistics.median(xs)) if xs else "-"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s chaos %(message)s")
    config = ScheduleConfig(
        num_groups=args.groups,
        nproc_per_group=args.nproc_per_group,
        num_steps=args.steps,
        num_faults=args.faults,
        seed=args.seed,
        kinds=parse_kinds(args.kinds),
        min_delay_s=args.min_delay_s,
        max_delay_s=args.max_delay_s,
        warmup_steps=args.warmup_steps,
        tail_steps=args.tail_steps,
    )
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    runner = Runner(args, out, make_schedule(config))
    for i, f in enumerate(runner.schedule):
        logger.info("scheduled %d: %s", i, f)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        runner.run()
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process")
        runner.kill_all()
        return 130
    except BaseException:
        runner.kill_all()
        raise
    left = runner.kill_all()
    return report(runner, left)


if __name__ == "__main__":
    sys.exit(main())
