"""End to end: the chaos runner (python -m tools.chaos) with real
torchrun groups, real SIGKILL and SIGSTOP, and a real lighthouse restart."""

from __future__ import annotations

import json
import shutil
import signal

import psutil
import pytest

from tests.procs import PYTHON, REPO
from tests.waiting import wait_until
from tools.procs import tree


def run_chaos(children, tmp_path, args: list[str], timeout: float) -> dict:
    """Runs the chaos runner to its end; returns its summary.json."""
    out = tmp_path / "chaos"
    runner = children.spawn(
        [PYTHON, "-m", "tools.chaos", "--step-sleep", "0.2", "--max-delay-s", "1.5",
         "--timeout", str(timeout - 20), "--out", str(out), *args],
        log=tmp_path / "chaos.log",
    )  # fmt: skip
    rc = runner.wait(timeout=timeout)
    log = (tmp_path / "chaos.log").read_text()
    assert rc == 0, f"chaos runner failed:\n{log[-4000:]}"
    assert "CHECKS PASSED" in log and "goodput" in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == []
    assert all(f["rejoin_s"] is not None for f in summary["faults"]), "a victim never came back"
    assert len({f["hash"] for f in summary["finals"].values()}) == 1
    return summary


def fired(summary: dict) -> list[str]:
    return sorted(f["fault"]["kind"] for f in summary["faults"] if f["fired_at"] is not None)


@pytest.mark.timeout(260)
def test_group_kills_a_hang_and_a_lighthouse_restart_all_heal_and_end_bit_identical(
    children, tmp_path
):
    summary = run_chaos(
        children, tmp_path,
        ["--groups", "3", "--nproc-per-group", "1", "--steps", "60", "--faults", "5",
         "--seed", "1",
         "--kinds", "kill_group,kill_group,kill_group,stop_group,restart_lighthouse"],
        timeout=240,
    )  # fmt: skip
    assert fired(summary) == ["kill_group"] * 3 + ["restart_lighthouse", "stop_group"]
    assert len(summary["finals"]) == 3


@pytest.mark.timeout(260)
def test_a_killed_rank_is_restarted_by_torchrun_and_then_by_the_runner(children, tmp_path):
    # Under torchdata's StatefulDataLoader, as the exactly-once data check sees.
    # Seed 0 kills rank 0 then rank 1 of group 1; with --max-restarts 1 torchrun
    # restarts its workers after the first and gives up after the second.
    summary = run_chaos(
        children, tmp_path,
        ["--groups", "2", "--nproc-per-group", "2", "--steps", "40", "--faults", "2",
         "--seed", "0", "--kinds", "kill_rank", "--max-restarts", "1", "--loader", "stateful"],
        timeout=240,
    )  # fmt: skip
    assert fired(summary) == ["kill_rank", "kill_rank"]
    log = (tmp_path / "chaos.log").read_text()
    assert "group 1: torchrun exited" in log
    starts = (tmp_path / "chaos" / "group1.jsonl").read_text().count('"event": "start"')
    assert starts == 3, "expected the first start, torchrun's restart and the runner's"


@pytest.mark.timeout(200)
def test_correlated_faults_heal_with_survivors_stalled_briefly_and_end_bit_identical(
    children, tmp_path
):
    # Seed 1 draws each correlated kind once: a lighthouse kill while a
    # restarted group heals, two groups at once, a rank in each of two groups,
    # a second group killed as the survivors reconfigure without the first.
    # About a minute here; the real bound (a heartbeat) is for long runs.
    summary = run_chaos(
        children, tmp_path,
        ["--groups", "3", "--nproc-per-group", "2", "--steps", "60", "--faults", "4",
         "--seed", "1", "--correlated"],
        timeout=180,
    )  # fmt: skip
    kinds = ["kill_in_reconfigure", "kill_rank_pair", "kill_two_groups"]
    assert fired(summary) == kinds + ["restart_lighthouse_in_heal"]
    assert sorted(summary["by_kind"]) == sorted(kinds + ["restart_lighthouse_in_heal"])
    assert all(k["count"] == 1 and k["stall_worst_s"] is not None
               for k in summary["by_kind"].values())  # fmt: skip
    worst = summary["worst_stall_outside_lighthouse_s"]
    assert worst == max(summary["by_kind"][k]["stall_worst_s"] for k in kinds)
    assert worst <= 10, f"survivors stalled {worst:.1f} s by a correlated fault"
    for f in summary["faults"]:
        victims = [g for g in (f["fault"]["group"], f["fault"]["second_group"]) if g is not None]
        assert not set(victims) & set(f["survivors"]) and f["survivors"], f
    assert len(summary["finals"]) == 3


@pytest.mark.timeout(120)
def test_interrupting_the_runner_kills_every_child_of_the_script_it_was_given(children, tmp_path):
    # A copy under another name: only --script can have started its workers.
    script = tmp_path / "given_train.py"
    shutil.copy(REPO / "examples" / "train_ddp.py", script)
    runner = children.spawn(
        [PYTHON, "-m", "tools.chaos", "--script", str(script), "--groups", "2",
         "--nproc-per-group", "1", "--steps", "1000", "--faults", "0",
         "--out", str(tmp_path / "chaos")],
        log=tmp_path / "chaos.log",
    )  # fmt: skip
    procs: list[psutil.Process] = []

    def two_workers() -> bool:
        procs[:] = tree(runner.pid)
        return sum(_program(p) == str(script.resolve()) for p in procs) == 2

    wait_until(two_workers, 90, "the runner to start the workers of two groups")
    runner.send_signal(signal.SIGINT)
    assert runner.wait(timeout=30) == 130
    alive = [p for p in procs[1:] if _running(p)]
    assert not alive, f"children outlived the interrupted runner: {alive}"


def _program(p: psutil.Process) -> str | None:
    """What the Python process runs: its script, or its -m module. The runner
    and torchrun also name the script, but among their arguments."""
    try:
        return next((arg for arg in p.cmdline()[1:] if not arg.startswith("-")), None)
    except psutil.Error:
        return None


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
