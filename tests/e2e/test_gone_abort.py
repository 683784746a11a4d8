"""End to end: a replica group stopped (SIGSTOP) or killed (SIGKILL) inside
a collective costs the survivors about a heartbeat timeout, not the
collective timeout (30 s here): the lighthouse tells them the group is gone
(lighthouse.gone) and their Managers abort the collective
(torchft_like.gone_watch). A real lighthouse process, one process per
group (tests/e2e/_stall_worker.py), real signals."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.procs import PYTHON, wait_for_line
from tools.procs import read_jsonl, signal_tree

HEARTBEAT_TIMEOUT_MS = 1000
COLLECTIVE_TIMEOUT_S = 30.0
MAX_STALL_S = 1.5
HOLD_AFTER = 5
"""Steps the victim commits with every group before it holds in a collective."""


def start_lighthouse(children) -> str:
    proc = children.spawn(
        [PYTHON, "-m", "lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0",
         "--http-bind", "", "--heartbeat-timeout-ms", str(HEARTBEAT_TIMEOUT_MS),
         "--join-timeout-ms", "1000"]
    )  # fmt: skip
    return wait_for_line(proc, r"listening on (http://\S+)", timeout=30).group(1)


def commits(path: Path) -> list[dict]:
    return [r for r in read_jsonl(path) if r["committed"]] if path.exists() else []


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def stall_around(records: list[dict], fault_t: float) -> float:
    """The longest gap between consecutive commits from just before the fault on."""
    times = [r["t"] for r in records]
    before = [t for t in times if t <= fault_t]
    after = [t for t in times if t > fault_t]
    assert before and after, "no commit on one side of the fault"
    gaps = [b - a for a, b in zip([before[-1], *after], after)]
    return max(gaps)


def run_scenario(
    children, tmp_path: Path, groups: int, sig: int, pg: str = "gloo", abort: bool = True,
    hold_after: int = HOLD_AFTER,
) -> float:  # fmt: skip
    """Starts `groups` groups; the last holds inside a collective and gets
    `sig`. Returns the survivors' longest stall (s) around it."""
    lighthouse = start_lighthouse(children)
    victim = groups - 1
    hold_file = tmp_path / "held"
    procs = []
    for group in range(groups):
        args = [PYTHON, "tests/e2e/_stall_worker.py", "--lighthouse", lighthouse,
                "--group", str(group), "--groups", str(groups), "--pg", pg,
                "--timeout-s", str(COLLECTIVE_TIMEOUT_S),
                "--log", str(tmp_path / f"g{group}.jsonl")]  # fmt: skip
        if group == victim:
            args += ["--hold-after", str(hold_after), "--hold-file", str(hold_file)]
        if not abort:
            args.append("--no-abort")
        procs.append(children.spawn(args, log=tmp_path / f"g{group}.log"))
    try:
        wait_until(hold_file.exists, 90, "the victim to hold inside a collective")
    except AssertionError:
        logs = "".join((tmp_path / f"g{g}.log").read_text()[-2000:] for g in range(groups))
        raise AssertionError(f"the victim never held; logs:\n{logs}") from None
    signal_tree(procs[victim].pid, sig)
    fault_t = float(hold_file.read_text())
    survivors = [tmp_path / f"g{g}.jsonl" for g in range(victim)]
    wait_until(
        lambda: all(len([r for r in commits(p) if r["t"] > fault_t]) >= 5 for p in survivors),
        COLLECTIVE_TIMEOUT_S + 30,
        "the survivors to commit 5 steps without the victim",
    )
    for path in survivors:
        records = commits(path)
        assert any(r["participants"] == groups for r in records if r["t"] <= fault_t)
        assert all(r["participants"] == groups - 1 for r in records[-3:]), records[-3:]
    return max(stall_around(commits(p), fault_t) for p in survivors)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "groups, sig",
    [(2, signal.SIGSTOP), (3, signal.SIGSTOP), (3, signal.SIGKILL)],
    ids=["2-groups-sigstop", "3-groups-sigstop", "3-groups-sigkill"],
)
def test_a_group_gone_inside_a_collective_costs_the_survivors_a_heartbeat_timeout(
    children, tmp_path, groups, sig
):
    stall_s = run_scenario(children, tmp_path, groups, sig)
    print(f"survivors' longest stall: {stall_s:.2f} s")
    assert stall_s <= MAX_STALL_S, (
        f"the survivors stalled {stall_s:.2f} s (collective timeout {COLLECTIVE_TIMEOUT_S} s)"
    )
