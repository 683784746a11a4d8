"""The `torchft-lighthouse` console script as a real process."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from lighthouse import LighthouseClient
from tests.procs import PYTHON, wait_for_line

pytestmark = pytest.mark.timeout(60)


def lighthouse_command() -> list[str]:
    script = shutil.which("torchft-lighthouse")
    return [script] if script else [PYTHON, "-m", "lighthouse"]


def test_console_script_forms_a_quorum_and_serves_status_and_metrics(children):
    proc = children.spawn(
        lighthouse_command()
        + ["--min_replicas", "2", "--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0"]
    )
    http = wait_for_line(proc, r"status page on (http://\S+)", timeout=10).group(1)
    grpc_addr = wait_for_line(proc, r"listening on (http://\S+)", timeout=10).group(1)

    def join(rid):
        return LighthouseClient(grpc_addr).quorum(rid, timedelta(seconds=20), step=3)

    with ThreadPoolExecutor(2) as pool:
        quorums = list(pool.map(join, ["a", "b"]))
    assert quorums[0] == quorums[1] and quorums[0].replica_ids() == ("a", "b")
    with urllib.request.urlopen(http + "/status.json", timeout=5) as r:
        assert json.load(r)["quorum_id"] == quorums[0].quorum_id
    with urllib.request.urlopen(http + "/metrics", timeout=5) as r:
        assert "torchft_lighthouse_heartbeats_total" in r.read().decode()
    proc.terminate()
    assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--min-replicas", "0"], "min_replicas (0) must be at least 1"),
        (["--min-replicas", "1", "--bind", "nonsense"], "bind address 'nonsense' is not host:port"),
    ],
)
def test_bad_flags_exit_non_zero_with_one_clear_line(args, message):
    out = subprocess.run(
        lighthouse_command() + args + ["--http-bind", ""],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_a_port_in_use_exits_non_zero_without_a_traceback(children):
    first = children.spawn(
        lighthouse_command() + ["--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", ""]
    )
    port = wait_for_line(first, r"listening on http://\S+:(\d+)", timeout=10).group(1)
    out = subprocess.run(
        lighthouse_command()
        + ["--min-replicas", "1", "--bind", f"127.0.0.1:{port}", "--http-bind", ""],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0
    assert "port is in use" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        ("garbage", "is not a lighthouse state file"),
        (None, "does not exist or is not writable"),
    ],
)
def test_a_bad_state_file_exits_non_zero_with_one_clear_line(tmp_path, content, message):
    path = tmp_path / "state.json"
    if content is None:
        path = tmp_path / "missing" / "state.json"
    else:
        path.write_text(content)
    out = subprocess.run(
        lighthouse_command()
        + ["--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "", "--state-file",
           str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )  # fmt: skip
    assert out.returncode == 2
    assert message in out.stderr and str(path) in out.stderr
    assert "Traceback" not in out.stderr


def test_the_lighthouse_lifts_its_soft_descriptor_limit_to_the_hard_one():
    """Its connection cap follows the soft limit: 1,024 would cap it at 960 groups."""
    script = "from lighthouse.cli import raise_nofile; print(raise_nofile())"
    out = subprocess.run(
        ["bash", "-c", f'ulimit -Sn 256 && ulimit -Hn 4096 && "{PYTHON}" -c "{script}"'],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "4096"
