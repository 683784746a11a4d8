"""End to end: two jobs on one lighthouse process, as real torchrun groups
running examples/train_ddp.py with the same REPLICA_GROUP_IDs in both jobs
(TORCHFT_JOB_ID tells them apart): each job's quorums hold only its own
groups, a group SIGKILLed in one job heals within it while the other job
trains on at its pace, a job's secret is refused in another job, and a
lighthouse SIGKILLed and restarted with its --state-file brings both jobs back."""

from __future__ import annotations

import json
import re
import statistics
import time
from datetime import timedelta
from pathlib import Path

import pytest

from lighthouse import LighthouseClient, QuorumError
from lighthouse.rpc import auth
from tests.e2e.test_kill_and_recover import finals, last_step, start_group, steps, stop_at
from tests.procs import PYTHON
from tests.waiting import wait_until
from tools.procs import kill_tree, read_jsonl

pytestmark = pytest.mark.timeout(120)

JOBS = ("a", "b")
QUORUM_LINE = re.compile(r"job (\S+): quorum (\d+) issued \(")


def start_lighthouse(children, log: Path, port: int = 0, *flags: str) -> tuple:
    """A lighthouse process on `port` (0: any), its output appended to `log`;
    returns it and its address. Tried again while it exits at once: its port
    may still be held a moment after a SIGKILL."""
    started = []

    def start() -> bool:
        offset = log.stat().st_size if log.exists() else 0
        proc = children.spawn(
            [PYTHON, "-m", "lighthouse", "--min-replicas", "1", "--bind", f"127.0.0.1:{port}",
             "--http-bind", "", "--join-timeout-ms", "1000", *flags],
            log=log,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while proc.poll() is None:
            found = re.search(r"listening on (http://\S+)", log.read_text()[offset:])
            if found:
                started.append((proc, found.group(1)))
                return True
            assert time.monotonic() < deadline, f"no lighthouse:\n{log.read_text()[-3000:]}"
            time.sleep(0.02)
        return False

    wait_until(start, 30, lambda: f"a lighthouse on port {port}:\n{log.read_text()[-3000:]}")
    return started[0]


def quorums(log: Path) -> list[tuple[str, list[str]]]:
    """(job, members) of every quorum the lighthouse logged as issued: each
    new quorum is logged (the same members again, every step, is not)."""
    found = []
    for line in log.read_text().splitlines():
        match = QUORUM_LINE.search(line)
        if match:
            members = line.rsplit("): ", 1)[1].split(", ")
            found.append((match.group(1), [m.split(" step=")[0] for m in members]))
    return found


def replica_ids(folder: Path, groups: int = 2) -> set[str]:
    """The `{name}:{uuid}` of every start of the job's groups (a restart appends)."""
    return {
        r["replica_id"]
        for g in range(groups)
        for r in read_jsonl(folder / f"group{g}.jsonl")
        if r["event"] == "start"
    }


def together(log: Path, n: int, groups: int = 2) -> bool:
    return sum(r["participants"] == groups and r["committed"] for r in steps(log)) >= n


def kill_and_restart(children, folder: Path, lighthouse: str, job: str, procs: list) -> float:
    """SIGKILLs the job's group 1, restarts it and waits until it healed and
    committed; returns when it was killed."""
    log = folder / "group1.jsonl"
    assert not kill_tree(procs[1].pid), "the victim's processes survived SIGKILL"
    killed_at = time.time()
    procs[1] = start_group(children, folder, lighthouse, 1, env={"TORCHFT_JOB_ID": job})
    wait_until(
        lambda: sum(r["t"] > killed_at and r["committed"] for r in steps(log)) >= 2,
        60,
        f"job {job}'s restarted group to commit",
    )
    after = [r for r in steps(log) if r["t"] > killed_at]
    assert after[0]["healed"], f"job {job}'s restarted group did not heal first"
    return killed_at


def assert_trained_on(log: Path, job: str, since: float, until: float) -> None:
    """Every step of the group in [since, until] committed with both groups,
    none after a gap much longer than the group's ordinary step before."""
    records = steps(log)
    before = [r["t"] for r in records if r["t"] <= since]
    during = [r for r in records if since < r["t"] <= until]
    assert len(during) >= 5, f"job {job} trained {len(during)} steps meanwhile"
    assert all(r["committed"] and r["participants"] == 2 for r in during), (
        f"job {job} lost a step or a member meanwhile: {during}"
    )
    recent = before[-21:]
    assert len(recent) >= 6, f"job {job} trained {len(recent)} steps before"
    ordinary_s = statistics.median(b - a for a, b in zip(recent, recent[1:]))
    times = before[-1:] + [r["t"] for r in during]
    stall_s = max(b - a for a, b in zip(times, times[1:]))
    print(f"job {job}: longest step gap {stall_s:.2f} s (ordinary {ordinary_s:.2f} s)")
    assert stall_s < ordinary_s + 1.5, f"job {job} stalled {stall_s:.2f} s"


def test_two_jobs_with_the_same_group_ids_train_apart_and_each_heals_alone(children, tmp_path):
    """Jobs a and b, each of groups 0 and 1 on one lighthouse. Group 1 of b is
    SIGKILLed and restarted: it heals from b's group 0 while a trains on
    without a stall; then the same in a while b trains on. Each job ends
    bit-identical within itself, and no quorum ever mixed the jobs."""
    proc, lighthouse = start_lighthouse(children, tmp_path / "lighthouse.log")
    folders = {job: tmp_path / job for job in JOBS}
    procs = {}
    for job, folder in folders.items():
        folder.mkdir()
        procs[job] = [
            start_group(children, folder, lighthouse, g, env={"TORCHFT_JOB_ID": job})
            for g in (0, 1)
        ]
    logs = {job: folder / "group0.jsonl" for job, folder in folders.items()}
    # Together, not just far: a group 1 that trained alone would take its
    # job's only state with it when killed.
    wait_until(
        lambda: all(together(folder / "group1.jsonl", 5) for folder in folders.values()),
        90,
        "both jobs to train 5 steps with both their groups",
    )

    b_killed = kill_and_restart(children, folders["b"], lighthouse, "b", procs["b"])
    b_back = time.time()
    assert_trained_on(logs["a"], "a", b_killed, b_back)
    a_killed = kill_and_restart(children, folders["a"], lighthouse, "a", procs["a"])
    assert_trained_on(logs["b"], "b", a_killed, time.time())

    for job, folder in folders.items():
        final = last_step(logs[job]) + 5
        for g in (0, 1):
            stop_at(folder, g, final)
    for job in JOBS:
        for group in procs[job]:
            assert group.wait(timeout=60) == 0
        ends = finals(folders[job])
        assert ends[0]["step"] == ends[1]["step"] and ends[0]["hash"] == ends[1]["hash"], (
            f"job {job}'s groups are not bit-identical at the end: {ends}"
        )

    # Three starts per job (group 1's restart included), two names shared by
    # the jobs: only the uuid of each start tells them apart.
    ids = {job: replica_ids(folder) for job, folder in folders.items()}
    assert all(len(ids[job]) == 3 for job in JOBS), ids
    issued = quorums(tmp_path / "lighthouse.log")
    for job in JOBS:
        mine = [members for j, members in issued if j == job]
        assert any(len(members) == 2 for members in mine), f"job {job}: {mine}"
        for members in mine:
            assert set(members) <= ids[job], f"job {job}'s quorum names others: {members}"
    assert {j for j, _ in issued} == set(JOBS)
    assert proc.poll() is None


def test_a_job_secret_is_refused_in_another_job_and_both_jobs_outlive_a_lighthouse_restart(
    children, tmp_path
):
    """Jobs a and b with secrets of their own (--job-secrets), one group
    each: a group of a with b's secret exits naming job 'a', the lighthouse
    and both jobs untouched. Then the lighthouse is SIGKILLed and restarted
    on its port with its --state-file: both jobs resume their steps."""
    secrets = {job: f"secret-of-{job}-0123456789" for job in JOBS}
    files = {}
    for job, secret in secrets.items():
        files[job] = tmp_path / f"{job}.secret"
        files[job].write_text(secret + "\n")
        files[job].chmod(0o600)
    flags = ["--job-secrets", *(f"{job}={files[job]}" for job in JOBS)]
    state = tmp_path / "lighthouse.json"
    flags += ["--state-file", str(state)]
    output = tmp_path / "lighthouse.log"
    first, lighthouse = start_lighthouse(children, output, 0, *flags)
    port = int(lighthouse.rsplit(":", 1)[1])
    folders = {job: tmp_path / job for job in JOBS}
    groups = {}
    for job, folder in folders.items():
        folder.mkdir()
        env = {"TORCHFT_JOB_ID": job, auth.SECRET_FILE_ENV: str(files[job])}
        groups[job] = start_group(children, folder, lighthouse, 0, groups=1, env=env)
    intruder_dir = tmp_path / "intruder"
    intruder_dir.mkdir()
    intruder = start_group(children, intruder_dir, lighthouse, 1, env={
        "TORCHFT_JOB_ID": "a", auth.SECRET_FILE_ENV: str(files["b"])})  # fmt: skip

    # The same refusal to a client of the test process, no Manager between.
    client = LighthouseClient(lighthouse, secret=secrets["b"], job_id="a")
    try:
        with pytest.raises(QuorumError, match=r"job 'a' requires .* carried a wrong one"):
            client.quorum("stray", timedelta(seconds=5))
    finally:
        client.close()
    assert intruder.wait(timeout=60) != 0
    refused_at = time.time()
    text = (intruder_dir / "group1.log").read_text(errors="replace")
    assert "this lighthouse's job 'a' requires the job's shared secret" in text, text[-3000:]
    assert "carried a wrong one" in text and "UNAUTHENTICATED" in text, text[-3000:]
    assert not steps(intruder_dir / "group1.jsonl"), "the intruder trained"

    logs = {job: folder / "group0.jsonl" for job, folder in folders.items()}
    mark = 15
    wait_until(
        lambda: all(
            last_step(log) >= mark and any(r["t"] > refused_at for r in steps(log))
            for log in logs.values()
        ),
        90,
        f"both jobs to train past step {mark} and after the refusal",
    )
    assert first.poll() is None, "the lighthouse died"
    assert not kill_tree(first.pid), "the lighthouse survived SIGKILL"
    killed_at = time.time()
    before = {job: last_step(log) for job, log in logs.items()}
    restarted_at = output.stat().st_size
    second, _ = start_lighthouse(children, output, port, *flags)
    wait_until(
        lambda: all(last_step(log) >= before[job] + 5 for job, log in logs.items()),
        60,
        "both jobs to train 5 steps past the restart",
    )
    for job, log in logs.items():
        stop_at(folders[job], 0, last_step(log) + 2)
    for job in JOBS:
        assert groups[job].wait(timeout=60) == 0

    opened = output.read_text()[restarted_at:]
    for job, log in logs.items():
        # The restarted lighthouse knew the job from its file ...
        found = re.search(rf"job {job}: job opened from its state file \(high-water mark step "
                          r"(\d+)\)", opened)  # fmt: skip
        assert found, f"job {job} not restored:\n{opened}"
        # The step a member asked its quorum at; a mark that only grew is
        # written every 0.1 s at most (lighthouse.shell.state_file): it lags.
        assert before[job] - 8 <= int(found.group(1)) <= before[job], (found[0], before[job])
        saved = json.loads(Path(f"{state}.jobs/{job}.json").read_text())
        assert saved["high_water_step"] > before[job]
        # ... and its group went on from its step in the same quorum (the
        # file's: a lighthouse without it issues a new id): no fresh start.
        records = steps(log)
        last_id = [r["quorum_id"] for r in records if r["t"] <= killed_at][-1]
        after = [r for r in records if r["t"] > killed_at and r["committed"]]
        assert before[job] <= after[0]["step"] <= before[job] + 1, f"job {job}: {after[:3]}"
        assert [r["step"] for r in after] == list(range(after[0]["step"], after[-1]["step"] + 1))
        assert not any(r["healed"] for r in after), f"job {job} healed: it started over"
        assert {r["quorum_id"] for r in after} == {last_id}, f"job {job} got a new quorum"
    # The default job, unused, holds none of theirs in the file it has (PATH).
    assert not state.exists() or json.loads(state.read_text())["members"] == []
    assert second.poll() is None
