"""Every benchmark runs once, tiny (--smoke), as a real process: no figure is
asserted, only that it finishes, prints its table and writes its results
where it is told (never into the repository)."""

from __future__ import annotations

import json

import pytest

from tests.procs import PYTHON, REPO

BENCH = REPO / "bench"
BENCHMARKS = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_"))
"""Every entry point, found, not listed: a benchmark nobody listed rots."""
TIMEOUT_S = 150
"""A bound, not the expected time: each takes 1-50 s on an idle 2-core machine."""


def test_every_private_bench_module_is_used_by_an_entry_point():
    """A helper (a worker script, a shared part) runs only through a
    benchmark, so the smoke runs below reach it; one that none names would
    rot unseen."""
    entries = "\n".join((BENCH / f"{name}.py").read_text() for name in BENCHMARKS)
    helpers = [p.stem for p in BENCH.glob("_*.py") if p.stem != "__init__"]
    assert helpers, "no helper modules found: has bench/ moved?"
    assert [h for h in helpers if h not in entries] == []


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
