"""scripts/gpu_check.sh as a real process on this machine (CI has no GPU:
every check skipped, exit 0), and the driver's run path with pytest as a
real child: a check's skip reason, figures and failure come back from the
JUnit XML, and a hung check is killed at its deadline without costing the
next one. The pure parts: tests/unit/test_gpu_check.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.procs import REPO

pytestmark = pytest.mark.timeout(120)
_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc
_spec.loader.exec_module(gc)
quiet = {"say": lambda *a, **k: None}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run")
def test_the_script_on_a_cpu_machine_reports_every_check_skipped_and_exits_0(tmp_path) -> None:
    out, logs = tmp_path / "gpu_check.json", tmp_path / "logs"
    start = time.monotonic()
    args = ["bash", "scripts/gpu_check.sh", "--out", str(out), "--logs", str(logs)]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 30, "the CPU mode is meant to run nothing heavy"
    report = json.loads(done.stdout)
    assert report == json.loads(out.read_text())
    assert report["gpus"] == 0 and report["passed"] is True
    assert [c["name"] for c in report["checks"]] == [c.name for c in gc.CHECKS]
    for c in report["checks"]:
        assert c["status"] == "skipped", c
        assert c["reason"] == "no CUDA device: torch.cuda.is_available() is False"
        assert c["what"] and c["test"].startswith("tests/gpu/") and c["figures"] == {}
    assert not logs.exists(), "no check may start without CUDA"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the test would run")
def test_a_planned_check_runs_its_pytest_test_and_reports_its_skip_reason(tmp_path) -> None:
    """The real node of a check, planned as if a GPU were here: the test is
    skipped by tests/conftest.py, and the reason reaches the entry."""
    check = next(c for c in gc.CHECKS if c.name == "http_heal_cuda")
    plan = gc.plan(gc.Probe(True, 1, True), [check])
    [entry] = gc.run(plan, 60, tmp_path, sys.executable, **quiet)
    assert entry["status"] == "skipped", entry
    assert entry["reason"] == "no CUDA device: torch.cuda.is_available() is False"
    assert entry["ran"] == f"pytest {check.variants[0].node} -m cuda"


FAKE = """
import time
import pytest

pytestmark = pytest.mark.cuda

def test_figures(record_property):
    record_property("mbps", "123.5")
    record_property("sizes", "[1, 2]")

def test_fails():
    assert 1 == 2, "the survivor stalled 3.0 s"

@pytest.mark.timeout(0)
def test_hangs():
    time.sleep(600)
"""


def fake_check(tmp_path: Path, name: str, timeout_s: float) -> object:
    path = tmp_path / "test_fake_gpu.py"
    path.write_text(FAKE)
    return gc.Check(name, "a fake", (gc.Variant(f"{path}::{name}", 1, "fake"),), timeout_s)


def test_figures_failures_and_a_hang_each_come_back_as_their_entry(tmp_path) -> None:
    checks = [fake_check(tmp_path, n, t) for n, t in
              [("test_hangs", 4), ("test_figures", 60), ("test_fails", 60)]]  # fmt: skip
    start = time.monotonic()
    hung, passed, failed = gc.run(
        gc.plan(gc.Probe(True, 1, True), checks), 100, tmp_path / "logs", sys.executable, **quiet
    )
    assert time.monotonic() - start < 60
    assert hung["status"] == "fail" and "past its 4 s deadline: killed" in hung["reason"], hung
    assert 4 <= hung["seconds"] < 20
    assert passed["status"] == "pass" and passed["figures"] == {"mbps": 123.5, "sizes": [1, 2]}
    assert failed["status"] == "fail" and "the survivor stalled 3.0 s" in failed["reason"]
    assert (tmp_path / "logs" / "test_fails.log").exists()


def test_the_budget_ends_what_it_cannot_hold(tmp_path) -> None:
    """A check started with 6 s of budget left gets those 6 s, not its own
    60; the next has less than `min_start_s` left and is not started."""
    checks = [fake_check(tmp_path, "test_hangs", 60), fake_check(tmp_path, "test_figures", 60)]
    start = time.monotonic()
    planned = gc.plan(gc.Probe(True, 1, True), checks)
    hung, later = gc.run(planned, 6, tmp_path / "logs", sys.executable, min_start_s=3, **quiet)
    assert time.monotonic() - start < 25
    assert "past its 6 s deadline" in hung["reason"]
    assert later["status"] == "fail" and later["reason"].startswith("not run: ")
