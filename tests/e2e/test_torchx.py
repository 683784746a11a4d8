"""End to end: the TorchX component launches a real job with TorchX's local
scheduler (`torchx run -s local_cwd`): two replica groups, each a torchrun,
train against a real lighthouse and end bit-identical."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_kill_and_recover import start_lighthouse
from tests.procs import PYTHON, REPO
from tools.procs import read_jsonl

pytest.importorskip("torchx", reason="torchx is in the dev extra: bash scripts/setup.sh")
pytestmark = pytest.mark.timeout(150)

TORCHX = str(Path(PYTHON).parent / "torchx")


def test_the_torchx_component_runs_two_groups_to_the_same_weights(children, tmp_path):
    lighthouse = start_lighthouse(
        children, heartbeat_timeout_ms=2000, extra=("--min-replicas", "2")
    )
    log = tmp_path / "steps.jsonl"  # both groups append their records here
    run = subprocess.run(
        [TORCHX, "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx'}", "--wait",
         "torchft_like/torchx.py:hsdp", "--replicas", "2", "--max_restarts", "0",
         "--lighthouse", lighthouse, "--script", "examples/train_ddp.py",
         "--", "--steps", "15", "--hidden", "32", "--log-json", str(log)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": f"{Path(PYTHON).parent}:{os.environ['PATH']}"},  # torchrun
    )  # fmt: skip
    assert run.returncode == 0, f"torchx run failed:\n{run.stdout}\n{run.stderr}"
    assert "SUCCEEDED" in run.stdout + run.stderr, run.stdout + run.stderr
    finals = [r for r in read_jsonl(log) if r["event"] == "final"]
    assert [f["step"] for f in finals] == [15, 15]
    assert finals[0]["hash"] == finals[1]["hash"], "the two groups ended with different weights"
