"""End to end: a second group dies while the survivor configures its process
group for the quorum that dropped the first. With a user's 30 s collective
timeout, the survivor must pay about a heartbeat, not the store and connect
timeouts: the lighthouse's gone notice ends the setup (torchft_like.manager.gone_watch
`unless_gone`), and the restarted groups are not refused while the survivor
is between quorums (lighthouse.core.quorum, "holder_wait"). Real torchrun groups of
two ranks, real SIGKILLs (bench.double_kill runs the sweep)."""

from __future__ import annotations

import subprocess

import pytest

from bench.double_kill import run_case
from tools.procs import kill_tree

pytestmark = pytest.mark.timeout(400)
MAX_STALL_S = 1.5


@pytest.mark.parametrize("mode, delay_s", [("worker", 0.0)])  # 59 s before the fix
def test_a_second_death_inside_the_reconfiguration_costs_the_survivor_a_heartbeat(
    tmp_path, mode, delay_s
):
    procs: list[subprocess.Popen] = []
    try:
        row = run_case(tmp_path / "case", mode, delay_s, procs)
    finally:
        alive = [p for proc in procs for p in kill_tree(proc.pid)]
        assert not alive, f"processes survived SIGKILL: {alive}"
    assert row["identical"], f"the replicas did not end bit-identical: {row}"
    assert row["survivor_stall_s"] <= MAX_STALL_S, row
