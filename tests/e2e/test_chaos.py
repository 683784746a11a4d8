"""End to end: the chaos runner (python -m torchft_like.chaos) with real
torchrun groups, real SIGKILL and SIGSTOP, and a real lighthouse restart."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from tests.procs import PYTHON
from torchft_like._procs import tree


@pytest.mark.timeout(200)
def test_a_small_chaos_schedule_ends_bit_identical_with_every_fault_healed(children, tmp_path):
    out = tmp_path / "chaos"
    runner = children.spawn(
        [PYTHON, "-m", "torchft_like.chaos", "--groups", "3", "--nproc-per-group", "2",
         "--steps", "60", "--faults", "4", "--seed", "3",
         "--kinds", "kill_group,kill_rank,kill_group,restart_lighthouse",
         "--step-sleep", "0.2", "--max-delay-s", "1.5", "--timeout", "170",
         "--out", str(out)],
        log=tmp_path / "chaos.log",
    )  # fmt: skip
    rc = runner.wait(timeout=190)
    log = (tmp_path / "chaos.log").read_text()
    assert rc == 0, f"chaos runner failed:\n{log[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == []
    faults = summary["faults"]
    kinds = sorted(f["fault"]["kind"] for f in faults if f["fired_at"] is not None)
    assert kinds == ["kill_group", "kill_group", "kill_rank", "restart_lighthouse"]
    assert all(f["rejoin_s"] is not None for f in faults), "a victim never committed again"
    hashes = {f["hash"] for f in summary["finals"].values()}
    assert len(summary["finals"]) == 3 and len(hashes) == 1
    assert "CHECKS PASSED" in log and "goodput" in log


@pytest.mark.timeout(120)
def test_interrupting_the_runner_kills_every_child(children, tmp_path):
    runner = children.spawn(
        [PYTHON, "-m", "torchft_like.chaos", "--groups", "2", "--nproc-per-group", "1",
         "--steps", "1000", "--faults", "0", "--out", str(tmp_path / "chaos")],
        log=tmp_path / "chaos.log",
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while True:
        procs = tree(runner.pid)
        workers = [p for p in procs if "train_ddp.py" in " ".join(_cmdline(p))]
        if len(workers) == 2:
            break
        assert time.monotonic() < deadline, "the runner never started two groups"
        time.sleep(0.2)
    runner.send_signal(signal.SIGINT)
    assert runner.wait(timeout=30) == 130
    alive = [p for p in procs[1:] if _running(p)]
    assert not alive, f"children outlived the interrupted runner: {alive}"


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
