"""Every benchmark runs once, tiny (--smoke), as a real process: no figure is
asserted, only that it finishes, prints its table and writes its results
where it is told (never into the repository)."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.procs import PYTHON, REPO, Children

BENCH = REPO / "bench"
BENCHMARKS = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_"))
"""Every entry point, found, not listed: a benchmark nobody listed rots."""
START_NS = time.time_ns()
"""Results in the repository older than this were there before the runs."""
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


WITH_JSON = {"lighthouse_jobs"}
"""Benchmarks whose smoke run also writes --json, whose figures a test below reads."""
CONCURRENT = 2
"""Smoke runs at a time: their processes mostly start up (imports) and wait
(kills detected, steps paced), so two at once take 148 s for the lot
against ~186 s one after another; figures are not what they check."""


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """bench name -> the future of its smoke run (exit code, output, results
    folder), all started on first use, CONCURRENT at a time."""
    children = Children()
    pool = ThreadPoolExecutor(CONCURRENT)

    def run(name: str) -> tuple[int | None, str, Path]:
        tmp = tmp_path_factory.mktemp(f"smoke_{name}")
        log, out = tmp / "out.log", tmp / "results"
        figures = ["--json", str(tmp / "figures.json")] if name in WITH_JSON else []
        proc = children.spawn(
            [PYTHON, "-m", f"bench.{name}", "--smoke", "--out", str(out), *figures], log=log
        )
        try:
            rc: int | None = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        return rc, log.read_text(errors="replace"), out

    runs = {name: pool.submit(run, name) for name in BENCHMARKS}
    yield runs
    pool.shutdown(wait=False, cancel_futures=True)
    children.kill_all()


@pytest.mark.timeout(2 * TIMEOUT_S + 15)
@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_in_its_smoke_configuration(name, smoke_runs):
    repo_results = REPO / "bench_results" / f"{name}.jsonl"
    rc, output, out = smoke_runs[name].result(timeout=2 * TIMEOUT_S)
    assert rc is not None, f"bench.{name} --smoke ran past {TIMEOUT_S} s:\n{output[-4000:]}"
    assert rc == 0, f"bench.{name} --smoke exited with {rc}:\n{output[-4000:]}"
    files = sorted(out.glob("*.jsonl"))
    assert files, f"bench.{name} wrote no results under {out}; output:\n{output[-4000:]}"
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert rows, f"bench.{name} wrote empty results {files}"
    # The printed table names the fields of the results.
    assert any(key in output for key in rows[0] if key != "time"), output[-4000:]
    assert not repo_results.exists() or repo_results.stat().st_mtime_ns < START_NS, (
        f"bench.{name} wrote into the repository: {repo_results}"
    )


@pytest.mark.timeout(2 * TIMEOUT_S + 15)
def test_lighthouse_jobs_smoke_writes_every_figure(smoke_runs):
    """bench.lighthouse_jobs --smoke (~15 s idle): both arrangements ran every
    job size, the fairness probe was measured with the others and alone,
    and the short-lived jobs were all forgotten (the gauge is back to the
    default job)."""
    rc, output, out = smoke_runs["lighthouse_jobs"].result(timeout=2 * TIMEOUT_S)
    assert rc == 0, f"exit {rc}:\n{output[-4000:]}"
    figures = out.parent / "figures.json"
    got = json.loads(figures.read_text())
    assert [row["size"] for row in got["sizes"]] == [60, 10, 2, "all"], got["sizes"]
    for row in got["sizes"][:-1]:
        assert row["ours_p99_ms"] > 0 and row["ref_p99_ms"] > 0, row
    assert got["sizes"][-1]["ours_rss_mb"] > 0 and got["sizes"][-1]["ref_cores"] > 0
    fair = got["fairness"]
    assert fair["with_p99_ms"] > 0 and fair["alone_p99_ms"] > 0 and fair["p99_ratio"] > 0, fair
    churn = got["churn"]
    assert churn["failed"] == 0 and churn["jobs_gauge_peak"] > 1, churn
    assert churn["jobs_gauge_after"] == 1, churn
