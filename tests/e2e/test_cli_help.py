"""Every command line says, in --help, which environment variables it reads
and gives an example; train_ddp.py outside torchrun says what it needs; the
installed lighthouse says its version, and a flag mistake in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "examples" / "train_ddp.py")
TORCHRUN = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN and k != "REPLICA_GROUP_ID"}
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=90, cwd=REPO, env={**base, **env}
    )


@pytest.mark.parametrize(
    "argv, names",
    [
        (
            [sys.executable, "-m", "lighthouse", "--help"],
            ["TORCHFT_SECRET_FILE", "TORCHFT_SECRET", "TORCHFT_LIGHTHOUSE"],
        ),
        (
            [sys.executable, TRAIN, "--help"],
            [
                "torchrun",
                "MASTER_PORT",
                "REPLICA_GROUP_ID",
                "NUM_REPLICA_GROUPS",
                "TORCHFT_LIGHTHOUSE",
                "TORCHFT_BIND_HOST",
                "TORCHFT_SECRET_FILE",
            ],
        ),  # fmt: skip
        ([sys.executable, "examples/demo.py", "--help"], ["TORCHFT_SECRET_FILE"]),
        ([sys.executable, "-m", "tools.chaos", "--help"], ["TORCHFT_SECRET_FILE"]),
    ],
)
def test_every_help_lists_its_environment_and_an_example(argv, names):
    proc = run(argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "environment" in proc.stdout
    assert "example: " in proc.stdout or "example:\n" in proc.stdout
    for name in names:
        assert name in proc.stdout, name


def test_train_ddp_without_torchrun_says_it_needs_torchrun_not_a_key_error():
    proc = run([sys.executable, TRAIN, "--steps", "1"])
    assert proc.returncode == 2
    assert "MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE not set" in proc.stderr
    assert "this script runs under torchrun" in proc.stderr
    assert "KeyError" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_replica_group_id_that_is_not_a_number_is_named_with_the_rule():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1"}
    proc = run([sys.executable, TRAIN, "--steps", "1"], REPLICA_GROUP_ID="one", **env)
    assert proc.returncode == 2
    assert "REPLICA_GROUP_ID='one'" in proc.stderr
    assert "an integer in [0, NUM_REPLICA_GROUPS)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_installed_torchft_lighthouse_says_its_version():
    import lighthouse

    script = Path(sys.executable).with_name("torchft-lighthouse")
    proc = run([str(script), "--version"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == f"torchft-lighthouse {lighthouse.__version__}\n"


def test_a_lighthouse_flag_mistake_exits_with_one_line_not_a_traceback():
    proc = run([sys.executable, "-m", "lighthouse", "--min-replicas", "1", "--log-level", "LOUD"])
    assert proc.returncode == 2
    assert proc.stderr.startswith("torchft-lighthouse: error: argument --log-level: invalid")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
