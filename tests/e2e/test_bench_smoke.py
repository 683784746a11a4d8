"""Every benchmark runs once, tiny (--smoke), as a real process: no figure is
asserted, only that it finishes, prints its table and writes its results
where it is told (never into the repository)."""

from __future__ import annotations

import json

import pytest

from tests.procs import PYTHON, REPO

BENCHMARKS = [
    "step_overhead",
    "control_plane",
    "lighthouse_latency",
    "transfer",
    "recovery",
    "lighthouse_load",
    "fingerprint",
    "auth_overhead",
    "checkpoint_overhead",
]
TIMEOUT_S = 90
"""A bound, not the expected time: each takes 1-25 s on an idle 2-core machine."""


@pytest.mark.timeout(TIMEOUT_S + 15)
@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_in_its_smoke_configuration(name, children, tmp_path):
    repo_results = REPO / "bench_results" / f"{name}.jsonl"
    before = repo_results.stat().st_mtime_ns if repo_results.exists() else None
    log = tmp_path / "out.log"
    out = tmp_path / "results"
    proc = children.spawn([PYTHON, "-m", f"bench.{name}", "--smoke", "--out", str(out)], log=log)
    rc = proc.wait(timeout=TIMEOUT_S)
    output = log.read_text(errors="replace")
    assert rc == 0, f"bench.{name} --smoke exited with {rc}:\n{output[-4000:]}"
    files = sorted(out.glob("*.jsonl"))
    assert files, f"bench.{name} wrote no results under {out}; output:\n{output[-4000:]}"
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert rows, f"bench.{name} wrote empty results {files}"
    # The printed table names the fields of the results.
    assert any(key in output for key in rows[0] if key != "time"), output[-4000:]
    after = repo_results.stat().st_mtime_ns if repo_results.exists() else None
    assert after == before, f"bench.{name} wrote into the repository: {repo_results}"
