"""bench.goodput's accounting: from the workers' JSON lines to the samples of
the final model's history, what was lost, what was trained twice, goodput.

Definitions (one run of one contender, a window (t0, end] of wall time; t0 is
when every replica group, or every rank, has committed a step):

- A *training* is one (epoch, sample id) that a committed step trained: the
  ids a group (or rank) logged for a step of the history in which it
  counted (a healing replica contributes zeros and trains nothing). They are
  logged before the gradients are averaged (replica groups) or right after
  (checkpoint-restart), so a group killed after it contributed to a step
  has its samples on record.
- The *final history* is every training logged at or before `end` that is
  not rolled back. torchft_like and torchft do not roll a committed step
  back, except a step committed only by groups that then died before any
  other copied their state: the survivors commit that step number again in
  a later quorum, and the later commit is the history
  (`replica_group_trainings`). Checkpoint-restart rolls back: when an
  incarnation of the job dies (a worker SIGKILLed, torchrun restarts them
  all), its steps after the checkpoint the next incarnation resumed from
  (its "start" record; if none by `end`, the newest checkpoint saved) are
  rolled back. They are not in the final history and count neither as
  trained nor as twice; their samples are trained again after the restart
  (`rolled_back_samples`).
- Each training has a global place g = epoch * N + p, where p is the
  sample's position in the epoch's order (bench._goodput_data: all three
  contenders order an epoch by the same permutation). The *frontier* F is
  the largest g trained; the *expected* samples are every g below
  F + 1 - slack: every epoch before the last in full, and the prefix of the
  last one (slack = one full step of every group, 3 x batch size, so a step
  in flight at `end` in one group but logged in another is not counted).
- `lost`: expected places never trained in the final history (a dead or
  healing group's share that no one trained, a restarted group's shard
  lagging behind the others, ...).
- `twice`: trainings beyond the first of the same place in the final
  history (count - 1, summed over places).
- `samples`: distinct places in the final history first trained inside the
  window (a place trained twice counts once). `samples_per_s` divides it by
  the window; goodput divides that by a fault-free run's `samples_per_s`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from bench._goodput_data import NUM_SAMPLES, epoch_positions


@dataclass
class Training:
    t: float
    epoch: int
    ids: list[int]
    rolled_back: bool = False


def replica_group_trainings(logs: list[list[dict[str, Any]]], end: float) -> list[Training]:
    """torchft_like / torchft: the samples of every step of the final history.

    Each group logs a step's samples before its backward pass ("attempt",
    with the step it tries and the quorum id) and the outcome of its own
    vote after ("step"). The history holds, for each step number, the latest
    quorum in which some group committed it: a step committed in two quorums
    was first committed by groups that died before anyone copied their
    state, so the final model does not descend from that commit
    (torchft_like's chaos check reads its history the same way). A commit
    of step s in quorum q means the allreduce completed, so it summed the
    gradients of every participant of q: each participant's samples of
    (s, q) count, whatever became of the participant itself afterwards (it
    may have failed its own vote, or been killed). A group that tried (s, q)
    twice (a retry in the same quorum) trained its last try."""
    latest: dict[int, int] = {}
    tries: dict[tuple[int, int, int], dict[str, Any]] = {}
    for index, records in enumerate(logs):
        attempt = None
        for r in records:
            if r["t"] > end:
                break
            if r["event"] == "attempt":
                attempt = r
                tries[(index, r["step"], r["quorum"])] = r
            elif r["event"] == "step" and attempt is not None:
                if r["committed"]:  # the step it committed (a healing group's jumps)
                    step, quorum = r["step"], attempt["quorum"]
                    latest[step] = max(latest.get(step, quorum), quorum)
                attempt = None
    return [
        Training(a["t"], a["epoch"], a["ids"])
        for (_, step, quorum), a in tries.items()
        if a["ids"] and latest.get(step) == quorum
    ]


def committed_steps(logs: list[list[dict[str, Any]]], t0: float, end: float) -> int:
    """Distinct committed step numbers that some group reached in (t0, end]."""
    return len(
        {
            r["step"]
            for records in logs
            for r in records
            if r["event"] == "step" and r.get("committed", True) and t0 < r["t"] <= end
        }
    )


def checkpoint_trainings(
    logs: list[list[dict[str, Any]]], end: float, kills_before_end: int
) -> tuple[list[Training], dict[int, int]]:
    """Checkpoint-restart: every rank's steps, those rolled back marked; and,
    per ended incarnation, the step it was rolled back to."""
    records = [r for rank in logs for r in rank if r["t"] <= end]
    last = max([r["inc"] for r in records] + [kills_before_end])
    resumed = {r["inc"]: r["resumed"] for r in records if r["event"] == "start"}
    saved = [(r["inc"], r["step"]) for r in records if r["event"] == "checkpoint"]
    back_to = {}
    for inc in range(last):  # every incarnation but the last ended by a fault
        if inc + 1 in resumed:
            back_to[inc] = resumed[inc + 1]
        else:
            back_to[inc] = max((s for i, s in saved if i <= inc), default=0)
    # A rank logs a step before its backward pass: in the last incarnation a
    # step is done once some rank has begun the next.
    steps = [r["step"] for r in records if r["event"] == "step" and r["inc"] == last]
    done = max(steps, default=0) - 1
    trainings = [
        Training(r["t"], r["epoch"], r["ids"], r["step"] > back_to.get(r["inc"], r["step"]))
        for r in records
        if r["event"] == "step" and (r["inc"] in back_to or r["step"] <= done)
    ]
    return trainings, back_to


def checkpoint_steps(logs: list[list[dict[str, Any]]], t0: float, end: float,
                     back_to: dict[int, int]) -> tuple[int, int]:  # fmt: skip
    """(steps in the final history, steps rolled back) committed in (t0, end]."""
    kept, rolled = set(), set()
    for r in (r for rank in logs for r in rank):
        if r["event"] == "step" and t0 < r["t"] <= end:
            gone = r["step"] > back_to.get(r["inc"], r["step"])
            (rolled if gone else kept).add((r["inc"], r["step"]))
    return len(kept), len(rolled)


def account(
    trainings: list[Training], t0: float, end: float, seed: int, slack: int
) -> dict[str, Any]:
    """The figures of the definitions above (see the module)."""
    positions: dict[int, list[int]] = {}
    counts: Counter[int] = Counter()
    first: dict[int, float] = {}
    rolled_back = 0
    for tr in sorted(trainings, key=lambda tr: tr.t):
        if tr.t > end:
            continue
        if tr.rolled_back:
            rolled_back += len(tr.ids)
            continue
        if tr.epoch not in positions:
            positions[tr.epoch] = epoch_positions(seed, tr.epoch)
        order = positions[tr.epoch]
        for sample in tr.ids:
            g = tr.epoch * NUM_SAMPLES + order[sample]
            counts[g] += 1
            first.setdefault(g, tr.t)
    frontier = max(counts, default=-1)
    expected = max(frontier + 1 - slack, 0)
    lost = sum(1 for g in range(expected) if g not in counts)
    window = end - t0
    samples = sum(1 for t in first.values() if t > t0)
    return {
        "samples": samples,
        "samples_per_s": samples / window if window > 0 else 0.0,
        "lost": lost,
        "twice": sum(c - 1 for c in counts.values() if c > 1),
        "rolled_back_samples": rolled_back,
        "epochs": frontier / NUM_SAMPLES if frontier >= 0 else 0.0,
    }


def longest_stall(times: list[float], t0: float, end: float) -> float:
    """Longest stretch of (t0, end] with no committed step anywhere."""
    points = [t0, *sorted(t for t in times if t0 < t <= end), end]
    return max(b - a for a, b in zip(points, points[1:]))


def replacement_times(
    logs: list[list[dict[str, Any]]], kills: list[dict[str, Any]], end: float
) -> list[float | None]:
    """Per kill of group g at time k: seconds from k to the first commit of
    the process that trains as g next (a restart, or a spare's takeover);
    None if none by `end`."""
    starts = [
        (r["t"], r["group"], records) for records in logs for r in records if r["event"] == "start"
    ]
    out: list[float | None] = []
    for kill in kills:
        if kill.get("missed"):
            continue
        after = sorted((t, recs) for t, g, recs in starts if g == kill["group"] and t > kill["t"])
        commit = next(
            (r["t"] for _, recs in after[:1] for r in recs
             if r["event"] == "step" and r["committed"] and r["t"] > kill["t"]),
            None,
        )  # fmt: skip
        out.append(commit - kill["t"] if commit is not None and commit <= end else None)
    return out


def restart_times(
    logs: list[list[dict[str, Any]]], kills: list[dict[str, Any]], end: float
) -> list[float | None]:
    """Checkpoint-restart, per kill at time k: seconds from k to the first
    step trained by the job's next incarnation; None if none by `end`."""
    records = sorted((r for rank in logs for r in rank), key=lambda r: r["t"])
    out: list[float | None] = []
    for kill in kills:
        inc = next(
            (r["inc"] for r in records if r["event"] == "start" and r["t"] > kill["t"]), None
        )
        step = next(
            (r["t"] for r in records
             if r["event"] == "step" and r["inc"] == inc and r["t"] > kill["t"]),
            None,
        )  # fmt: skip
        out.append(step - kill["t"] if step is not None and step <= end else None)
    return out
