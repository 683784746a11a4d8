"""bench.lighthouse_scale --attack, tiny: a run without the attack and one with an
attacking host beside it, as real processes; no figure is asserted (the bench's
criteria are for 1,000 groups), only that both runs are measured and the JSON has
every field the comparison reads."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.procs import PYTHON

TIMEOUT_S = 60
"""A bound: about 12 s on an idle 2-core machine (two lighthouses, four load
processes, one attacker, each a Python start)."""

pytestmark = pytest.mark.timeout(TIMEOUT_S + 15)

RUN_FIELDS = {
    "attack",
    "quorum_p50_ms",
    "quorum_p99_ms",
    "lighthouse_cores",
    "lighthouse_cpu_s",
    "rss_peak_mb",
    "refused",
    "reset",
    "failed_calls",
    "judged_gone",
    "attack_mb",
}
ROW_FIELDS = {
    "attack",
    "p50_ms",
    "p99_ms",
    "p99_ratio",
    "refused",
    "reset",
    "failed",
    "judged_gone",
    "cores",
    "attack_mb",
    "cpu_s_per_mb",
    "extra_cpu_s_per_mb",
    "rss_peak_mb",
    "meets",
    "misses",
}


def test_an_attack_run_is_measured_beside_the_run_without(children, tmp_path):
    out, log = tmp_path / "attack.json", tmp_path / "out.log"
    args = ["-m", "bench.lighthouse_scale", "--groups", "20", "--steps", "2", "--warmup", "1"]
    args += ["--step-s", "0.5", "--attack", "priority_flood", "--attack-round-s", "1"]
    proc = children.spawn([PYTHON, *args, "--json", str(out), "--out", str(tmp_path)], log=log)
    try:
        rc: int | None = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    output = log.read_text(errors="replace")
    assert rc == 0, f"exit code {rc}:\n{output[-4000:]}"
    figures = json.loads(out.read_text())
    without, under = figures["runs"]
    assert RUN_FIELDS <= without.keys() and RUN_FIELDS <= under.keys(), figures
    assert (without["attack"], under["attack"]) == (None, "priority_flood")
    assert without["attack_mb"] == 0 and under["attack_mb"] > 0, figures
    assert under["attack_rounds"] >= 1, under
    [row] = figures["attacks"]
    assert ROW_FIELDS <= row.keys(), row
    assert row["attack"] == "priority_flood" and row["cpu_s_per_mb"] is not None, row
    assert "p99_ratio" in output and "meets" in output, output[-4000:]  # the printed table
