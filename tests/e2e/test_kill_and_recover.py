"""End to end: a lighthouse process and replica groups as real torchrun jobs
running examples/train_ddp.py; real SIGKILL of a whole group, real restart."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.procs import PYTHON, wait_for_line
from tests.waiting import wait_until
from tools.chaos.checks import data_exactly_once, units_trained
from tools.chaos.runner import batch_record
from tools.procs import kill_tree, read_jsonl, signal_tree
from torchft_like.data import DistributedSampler

pytestmark = pytest.mark.timeout(150)


def last_step(path: Path) -> int:
    return max((r["step"] for r in read_jsonl(path) if r["event"] == "step"), default=0)


def start_lighthouse(
    children, heartbeat_timeout_ms: int, join_timeout_ms: int = 1000, extra: tuple = ()
) -> str:
    proc = children.spawn(
        [PYTHON, "-m", "lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0",
         "--http-bind", "", "--heartbeat-timeout-ms", str(heartbeat_timeout_ms),
         "--join-timeout-ms", str(join_timeout_ms), *extra]
    )  # fmt: skip
    return wait_for_line(proc, r"listening on (http://\S+)", timeout=15).group(1)


def start_group(
    children, tmp_path: Path, lighthouse: str, group: int, step_sleep: float = 0.05,
    groups: int = 2, transport: str = "http", env: dict | None = None,
):  # fmt: skip
    """Trains until the test writes a final step into the group's stop file, so
    no group can finish before a slow (re)start on a loaded machine catches up.
    `env`: more variables (TORCHFT_JOB_ID, TORCHFT_SECRET_FILE)."""
    return children.spawn(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         "examples/train_ddp.py", "--steps", "100000", "--hidden", "64",
         "--stop-file", str(tmp_path / f"group{group}.stop"), "--transport", transport,
         "--step-sleep", str(step_sleep), "--log-json", str(tmp_path / f"group{group}.jsonl")],
        log=tmp_path / f"group{group}.log",
        env={"TORCHFT_LIGHTHOUSE": lighthouse, "REPLICA_GROUP_ID": str(group),
             "NUM_REPLICA_GROUPS": str(groups), "TORCHFT_TIMEOUT_SEC": "5", **(env or {})},
    )  # fmt: skip


def stop_at(tmp_path: Path, group: int, step: int) -> None:
    (tmp_path / "stop.tmp").write_text(str(step))
    (tmp_path / "stop.tmp").rename(tmp_path / f"group{group}.stop")


def steps(path: Path) -> list[dict]:
    return [r for r in read_jsonl(path) if r["event"] == "step"]


def finals(tmp_path: Path, groups: int = 2) -> list[dict]:
    return [
        next(r for r in read_jsonl(tmp_path / f"group{g}.jsonl") if r["event"] == "final")
        for g in range(groups)
    ]


NUM_SAMPLES, BATCH_SIZE, SEED = 8192, 32, 0  # examples/train_ddp.py's data and defaults


def unit_samples(unit: int) -> list[int]:
    """The sample ids of a unit of data (one 1-rank group's batch), as
    torchft_like.DistributedSampler defines them under StepBatches."""
    sampler = DistributedSampler(range(NUM_SAMPLES), 0, 1, group_rank=0, num_replicas=1,
                                 seed=SEED)  # fmt: skip
    return sampler.unit_indices(unit, BATCH_SIZE)


def assert_exactly_once_data(tmp_path: Path, final: int, groups: int = 2) -> None:
    """Every unit of data below the final cursor was trained in exactly one
    committed step (tools.chaos.checks.data_exactly_once), each participant
    training the unit the quorum gave it, with the samples that unit holds.
    Group 0, a survivor, contributed to every step from its first."""
    batches = []
    for group in range(groups):
        records = [r for r in steps(tmp_path / f"group{group}.jsonl")
                   if r["participating_rank"] is not None]  # fmt: skip
        for r in records:
            assert r["sample_ids"] == unit_samples(r["data_unit"]), (
                f"group {group} trained other samples than unit {r['data_unit']}'s"
            )
            batches.append(batch_record(group, r))
        if group == 0:
            # From its first commit (a slow start may make it join, and heal,
            # after the other trained a few steps alone) to the end.
            done = sorted(r["step"] for r in records if r["committed"])
            assert done == list(range(done[0], final + 1))
    assert data_exactly_once(batches) == []
    assert units_trained(batches) >= final


@pytest.mark.parametrize(
    "transport, groups", [("http", 2), ("pg", 2), ("http", 3), ("pg", 3)]
)  # more groups: the same rule, table-tested (tests/unit/test_recovery.py, test_transfer_plan)
def test_a_killed_group_restarts_heals_and_ends_bit_identical(
    children, tmp_path, transport, groups
):
    """The last group is SIGKILLed and restarted; it heals from one of the
    survivors (over PGTransport from exactly one: a second sender would wait
    for a receiver that never comes, and stall every group)."""
    lighthouse = start_lighthouse(children, heartbeat_timeout_ms=1000)
    victim_id = groups - 1
    procs = [start_group(children, tmp_path, lighthouse, g, groups=groups, transport=transport)
             for g in range(groups)]  # fmt: skip
    log0, log1 = tmp_path / "group0.jsonl", tmp_path / f"group{victim_id}.jsonl"

    # Together, not just far: a victim that trained alone while a slow peer
    # started would take the job's only state with it, and the lighthouse
    # then rightly refuses a fresh start (as a CI run under load once did).
    wait_until(
        lambda: (
            last_step(log1) >= 15
            and sum(r["participants"] == groups and r["committed"] for r in steps(log1)) >= 5
        ),
        60 + 15 * groups,
        "the victim to reach step 15, 5 steps of them with every group",
    )
    assert not kill_tree(procs[victim_id].pid), "the victim's processes survived SIGKILL"
    killed_at = time.time()
    time.sleep(1.0)
    procs[victim_id] = start_group(
        children, tmp_path, lighthouse, victim_id, groups=groups, transport=transport
    )
    wait_until(
        lambda: any(r["t"] > killed_at and r["committed"] for r in steps(log1)),
        90,
        "the restarted group to commit a step",
    )
    final = last_step(log0) + 10
    for group in range(groups):
        stop_at(tmp_path, group, final)
    for proc in procs:
        assert proc.wait(timeout=60) == 0

    after_restart = [r for r in steps(log1) if r["t"] > killed_at]
    assert after_restart[0]["healed"], "the restarted group did not heal first"
    assert any(r["committed"] for r in after_restart[1:]), "the restarted group never committed"
    rejoined_at = after_restart[0]["t"]
    during_outage = [
        r for r in read_jsonl(log0)
        if r["event"] == "step" and killed_at < r["t"] < rejoined_at and r["committed"]
    ]  # fmt: skip
    assert len(during_outage) >= 5, "the survivor stopped committing while its peer was down"
    ends = finals(tmp_path, groups)
    assert {(r["step"], r["hash"]) for r in ends} == {(final, ends[0]["hash"])}, (
        f"replicas are not bit-identical at step {final}: {ends}"
    )
    assert_exactly_once_data(tmp_path, final, groups)


def test_a_group_that_leaves_on_purpose_does_not_stall_the_other(children, tmp_path):
    # A 20 s heartbeat timeout: only the Leave call (or the closed heartbeat
    # stream) can explain a short stall.
    lighthouse = start_lighthouse(children, heartbeat_timeout_ms=20_000)
    stayer = start_group(children, tmp_path, lighthouse, 0)
    leaver = start_group(children, tmp_path, lighthouse, 1)
    log0 = tmp_path / "group0.jsonl"
    wait_until(
        lambda: sum(r["participants"] == 2 and r["committed"] for r in steps(log0)) >= 10,
        90,
        "both groups to train together",
    )
    stop_at(tmp_path, 1, last_step(tmp_path / "group1.jsonl") + 5)
    assert leaver.wait(timeout=60) == 0
    stop_at(tmp_path, 0, last_step(log0) + 30)
    assert stayer.wait(timeout=60) == 0
    left_at = next(r["t"] for r in read_jsonl(tmp_path / "group1.jsonl") if r["event"] == "final")
    after = [
        r
        for r in read_jsonl(tmp_path / "group0.jsonl")
        if r["event"] == "step" and r["t"] > left_at
    ]
    assert after and all(r["committed"] for r in after)
    assert after[0]["t"] - left_at < 5, "the stayer waited for the leaver's heartbeat to expire"
    assert after[-1]["participants"] == 1


def test_killing_torchrun_alone_ends_its_worker_and_the_other_group_goes_on(children, tmp_path):
    # What the README tells users to do: kill -9 of torchrun, not of its tree.
    # A 20 s heartbeat timeout: only the worker's exit (its heartbeat stream
    # closing) can explain the survivor dropping it quickly.
    lighthouse = start_lighthouse(children, heartbeat_timeout_ms=20_000)
    survivor = start_group(children, tmp_path, lighthouse, 0)
    victim = start_group(children, tmp_path, lighthouse, 1)
    log0 = tmp_path / "group0.jsonl"
    wait_until(
        lambda: sum(r["participants"] == 2 and r["committed"] for r in steps(log0)) >= 5,
        90,
        "both groups to train together",
    )
    workers = psutil.Process(victim.pid).children(recursive=True)
    assert workers, "torchrun has no worker"
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    killed_wall = time.time()
    victim.wait(timeout=10)
    while alive := [w for w in workers if running(w)]:
        assert time.monotonic() - killed_at < 5, f"orphaned workers still run: {alive}"
        time.sleep(0.01)
    exit_s = time.monotonic() - killed_at
    print(f"orphaned worker exited {exit_s:.2f} s after torchrun's SIGKILL")
    assert exit_s < 1.5, f"the orphaned worker took {exit_s:.2f} s to exit"
    wait_until(
        lambda: any(
            r["t"] > killed_wall and r["committed"] and r["participants"] == 1 for r in steps(log0)
        ),
        15,
        "the survivor to commit without the dead group",
    )
    stop_at(tmp_path, 0, last_step(log0) + 3)
    assert survivor.wait(timeout=60) == 0
    assert "is gone" in (tmp_path / "group1.log").read_text()


def running(proc: psutil.Process) -> bool:
    """A zombie (an orphan not yet reaped by init) runs nothing: gone."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_missing_or_duplicate_replica_group_id_stops_the_script_naming_it(children, tmp_path):
    lighthouse = start_lighthouse(children, heartbeat_timeout_ms=20_000)
    env = {"TORCHFT_LIGHTHOUSE": lighthouse, "NUM_REPLICA_GROUPS": "2"}
    unnamed = children.spawn(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         "examples/train_ddp.py", "--steps", "5"],
        log=tmp_path / "unnamed.log", env=env,
    )  # fmt: skip
    first = start_group(children, tmp_path, lighthouse, 0)  # meanwhile
    assert unnamed.wait(timeout=60) != 0  # the worker's 2 becomes torchrun's 1
    text = (tmp_path / "unnamed.log").read_text()
    assert "REPLICA_GROUP_ID=None: it must be set" in text and "--standby-file" in text

    wait_until(lambda: last_step(tmp_path / "group0.jsonl") >= 3, 60, "group 0 to train")
    twin = children.spawn(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         "examples/train_ddp.py", "--steps", "5", "--hidden", "64"],
        log=tmp_path / "twin.log", env={**env, "REPLICA_GROUP_ID": "0"},
    )  # fmt: skip
    assert twin.wait(timeout=60) != 0
    text = (tmp_path / "twin.log").read_text()
    assert "replica group 'train_ddp_0' is already live" in text, text[-3000:]
    assert first.poll() is None, "the first group 0 stopped"


def test_a_stopped_group_is_left_out_within_a_second_and_heals_when_continued(children, tmp_path):
    # Default heartbeat timeout (5 s) and join timeout (60 s): only the hang
    # detector can leave the stopped group out quickly. (With it off the
    # survivor waits the heartbeat timeout: tests/unit/test_quorum.py.)
    lighthouse = start_lighthouse(children, 5000, join_timeout_ms=60_000)
    survivor = start_group(children, tmp_path, lighthouse, 0)
    # A long sleep after each step, and the stop sent right after a commit is
    # logged, so the hang lands between steps: the quorum is what must not
    # wait for it. (A group stopped inside a collective costs the others the
    # collective timeout; docs/reference.md, "What happens when...".)
    victim = start_group(children, tmp_path, lighthouse, 1, step_sleep=0.5)
    log0, log1 = tmp_path / "group0.jsonl", tmp_path / "group1.jsonl"
    wait_until(
        lambda: sum(r["participants"] == 2 and r["committed"] for r in steps(log0)) >= 20,
        90,
        "both groups to train together",
    )
    logged = log1.stat().st_size
    wait_until(lambda: log1.stat().st_size > logged, 30, "the victim to log its next step")
    signal_tree(victim.pid, signal.SIGSTOP)
    stopped_at = time.time()
    wait_until(
        lambda: sum(r["t"] > stopped_at and r["committed"] for r in steps(log0)) >= 10,
        30,
        "the survivor to go on alone",
    )
    signal_tree(victim.pid, signal.SIGCONT)
    continued_at = time.time()
    wait_until(
        lambda: any(r["t"] > continued_at and r["committed"] for r in steps(log1)),
        60,
        "the continued group to commit again",
    )
    commits = [r["t"] for r in steps(log0) if r["committed"]]
    before = [t for t in commits if t <= stopped_at]
    gaps = [b - a for a, b in zip(before[-20:], before[-19:])]
    ordinary_s = sorted(gaps)[len(gaps) // 2]
    after = [t for t in commits if t > stopped_at]
    stall_s = after[0] - before[-1]
    print(
        f"survivor stall {stall_s:.2f} s "
        f"(ordinary step {ordinary_s:.2f} s, extra {stall_s - ordinary_s:.2f} s)"
    )
    final = last_step(log0) + 10
    for group in (0, 1):
        stop_at(tmp_path, group, final)
    assert survivor.wait(timeout=60) == 0
    assert victim.wait(timeout=60) == 0
    assert any(r["healed"] for r in steps(log1) if r["t"] > continued_at), "it did not heal"
    a, b = finals(tmp_path)
    assert a["hash"] == b["hash"], "replicas are not bit-identical at the same step"
    assert stall_s - ordinary_s < 1.5, f"the survivor stalled {stall_s:.2f} s"
