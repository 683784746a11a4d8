"""The chaos run's verdict: checks, per-fault stall and rejoin table, goodput, summary.json."""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from tools.chaos import checks
from tools.chaos.runner import Outcome, Runner
from tools.chaos.schedule import RANK_KINDS, FaultKind


def report(runner: Runner, left: list[str]) -> int:
    """Checks the ended run, prints the per-fault table and the summary, and
    writes summary.json; returns the exit status (1 when a check failed).

    Args:
        runner: the run, after its loop returned.
        left: processes still running after the cleanup (each a failure).
    """
    a, records = runner.args, runner.records
    problems = list(runner.problems)
    problems += checks.step_regressions(records)
    problems += checks.committed_step_regressions(records)
    problems += checks.data_exactly_once(runner.batches)
    suspicions = _suspicions(runner.out / "lighthouse.log")
    problems += checks.false_suspicions(suspicions, _fault_windows(runner))
    print(f"groups left out as hung: {len(suspicions)} (one outside a fault on it fails the run)")
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
    _time_outcomes(runner)
    final_step = runner.leading_step()
    gp = checks.goodput(records, a.groups, final_step)

    print(
        f"\n fault | step | {'kind':<26} | {'victims':<13} | down s | survivor stall s | rejoin s |"
    )
    for o in sorted(runner.outcomes, key=lambda o: o.index):
        f = o.fault
        print(
            f" {o.index:>5} | {f.at_step:>4} | {f.kind.value:<26} | {f.victims():<13} "
            f"| {f.delay_s:>6.2f} | {_fmt(o.stall_s):>16} | {_fmt(o.rejoin_s):>8} | {o.note}"
        )
    done = [o for o in runner.outcomes if o.fired_at is not None]
    stalls = [o.stall_s for o in done if o.stall_s is not None]
    rejoins = [o.rejoin_s for o in done if o.rejoin_s is not None]
    print(f"\nfaults injected: {len(done)} of {len(runner.schedule)} scheduled (seed {a.seed})")
    print(f"survivor stall s: median {_med(stalls)}, worst {_fmt(max(stalls, default=None))}")
    print(f"rejoin s:         median {_med(rejoins)}, worst {_fmt(max(rejoins, default=None))}")
    by_kind = stalls_by_kind(done)
    for kind, k in by_kind.items():
        print(
            f"  {kind:<26} x{k['count']:<3} stall median {_fmt(k['stall_median_s'])} worst "
            f"{_fmt(k['stall_worst_s'])}, rejoin median {_fmt(k['rejoin_median_s'])} worst "
            f"{_fmt(k['rejoin_worst_s'])}"
        )
    worst = worst_stall_outside_lighthouse(done)
    print(
        "worst survivor stall outside lighthouse restarts: "
        + (f"{worst.stall_s:.2f} s (fault {worst.index}, {worst.fault.kind.value}, "
           f"{worst.fault.victims()})" if worst is not None and worst.stall_s is not None
           else "-")
    )  # fmt: skip
    print(
        f"data: {checks.units_trained(runner.batches)} units (group batches) trained, each "
        "in exactly one committed step"
        if not checks.data_exactly_once(runner.batches)
        else "data: NOT exactly once (see the problems)"
    )
    print(
        f"goodput {gp.goodput:.1%} ({gp.participant_steps} group-steps committed; fault-free "
        f"step {gp.fault_free_step_s:.3f} s); participation {gp.participation:.1%} of "
        f"{final_step} steps x {a.groups} groups"
    )
    for g in runner.groups:
        fin = g.final
        state = f"step {fin['step']} hash {fin['hash']} quorum {fin['quorum_id']}" if fin else ""
        print(f"group {g.index}: {state or 'no final state'}")
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
        "by_kind": by_kind,
        "worst_stall_outside_lighthouse_s": worst.stall_s if worst is not None else None,
    }
    (runner.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"logs and summary.json in {runner.out}")
    return 0 if not problems else 1


SUSPECTED = re.compile(r"suspected hung: ([^\]]*)\]")
GROUP_OF = re.compile(r"train_ddp_(\d+):\S+ silent")


def _suspicions(lighthouse_log: Path) -> list[checks.Suspicion]:
    """Groups each issued quorum left out as hung, from the lighthouse's log
    lines (asctime, local time, then ',ms')."""
    found = []
    for line in lighthouse_log.read_text(errors="replace").splitlines():
        listed = SUSPECTED.search(line)
        if not listed or " issued " not in line:
            continue
        stamp, _, millis = line[:23].partition(",")
        at = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
        found += [checks.Suspicion(at, int(g)) for g in GROUP_OF.findall(listed.group(1))]
    return found


def stalls_by_kind(outcomes: list[Outcome]) -> dict[str, dict[str, float | int | None]]:
    """Per fault kind (in FaultKind's order, kinds that fired only): count,
    median and worst survivor stall and rejoin time."""
    by_kind: dict[str, dict[str, float | int | None]] = {}
    for kind in FaultKind:
        of_kind = [o for o in outcomes if o.fault.kind == kind]
        if not of_kind:
            continue
        st = [o.stall_s for o in of_kind if o.stall_s is not None]
        rj = [o.rejoin_s for o in of_kind if o.rejoin_s is not None]
        by_kind[kind.value] = {
            "count": len(of_kind),
            "stall_median_s": statistics.median(st) if st else None,
            "stall_worst_s": max(st, default=None),
            "rejoin_median_s": statistics.median(rj) if rj else None,
            "rejoin_worst_s": max(rj, default=None),
        }
    return by_kind


def worst_stall_outside_lighthouse(outcomes: list[Outcome]) -> Outcome | None:
    """The fault with the worst survivor stall among those that leave the
    lighthouse up: a lighthouse restart stalls everyone by design."""
    timed = [o for o in outcomes if o.stall_s is not None and not o.fault.hits_lighthouse]
    return max(timed, key=lambda o: o.stall_s or 0.0, default=None)


def _fault_windows(runner: Runner) -> list[checks.FaultWindow]:
    return [
        checks.FaultWindow(g, o.fired_at, o.settled_at or time.time())
        for o in runner.outcomes
        if o.fired_at is not None
        for g in o.fault.groups
    ]


def _time_outcomes(runner: Runner) -> None:
    """Fills each settled fault's worst survivor stall and its rejoin time."""
    records = runner.records
    for o in runner.outcomes:
        unsettled = o.settled_at != o.settled_at  # NaN: hit the settle timeout
        if o.settled_at is None or o.fired_at is None or unsettled:
            continue
        # A survivor hit by a later fault stalls for its own reason from then on.
        stalls = []
        for g in o.survivors:
            hit = min(
                (x.fired_at for x in runner.outcomes
                 if g in x.fault.groups and x.fired_at is not None and x.fired_at > o.fired_at),
                default=float("inf"),
            )  # fmt: skip
            before = [r for r in records if r.t < hit]
            stalls.append(checks.survivor_stall_s(before, [g], o.fired_at, min(o.settled_at, hit)))
        o.stall_s = max(stalls, default=None)
        since = o.recovered_at if o.recovered_at is not None else o.fired_at
        fresh = records
        if o.fault.kind in RANK_KINDS:  # a step in flight at the kill may commit
            inc = o.incarnations
            fresh = [r for r in records if r.group not in inc or r.incarnation > inc[r.group]]
        if o.fault.groups:  # until every victim committed again
            firsts = [checks.first_commit_after(fresh, [g], since) for g in o.fault.groups]
            first = None if None in firsts else max(f for f in firsts if f is not None)
        else:  # the lighthouse: until the job committed again
            first = checks.first_commit_after(fresh, list(o.survivors), since)
        o.rejoin_s = first - since if first is not None else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _med(xs: list[float]) -> str:
    return _fmt(statistics.median(xs)) if xs else "-"
