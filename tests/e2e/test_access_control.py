"""Access control as an operator meets it: the lighthouse CLI and torchrun jobs
with a shared secret in a file, as real processes."""

from __future__ import annotations

import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from lighthouse import LighthouseClient, QuorumError
from lighthouse.rpc import auth
from tests.e2e.test_kill_and_recover import finals
from tests.e2e.test_lighthouse_cli import lighthouse_command
from tests.procs import PYTHON, wait_for_line
from torchft_like.manager.group.client import ManagerClient

pytestmark = pytest.mark.timeout(120)
S = "e2e-secret-0123456789abcdef"


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text(S + "\n")
    path.chmod(0o600)
    return path


def start_lighthouse(
    children, args: list[str], env: dict | None = None, min_replicas: int = 1
) -> str:
    proc = children.spawn(
        lighthouse_command()
        + ["--min-replicas", str(min_replicas), "--bind", "127.0.0.1:0", "--http-bind", "", *args],
        env=env,
    )
    addr = wait_for_line(proc, r"listening on (http://\S+)", timeout=15).group(1)
    wait_for_line(proc, r"access control: on \(shared secret\)", timeout=15)
    return addr


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_lighthouse_cli_takes_the_secret_from_a_file_and_refuses_calls_without_it(
    children, secret_file, how
):
    if how == "flag":
        addr = start_lighthouse(children, ["--secret-file", str(secret_file)])
    else:
        addr = start_lighthouse(children, [], env={auth.SECRET_FILE_ENV: str(secret_file)})
    good = LighthouseClient(addr, secret=S)
    bad = LighthouseClient(addr)
    try:
        assert good.quorum("a", timedelta(seconds=20)).replica_ids() == ("a",)
        with pytest.raises(QuorumError, match=r"carried none.*\(UNAUTHENTICATED\)"):
            bad.quorum("b", timedelta(seconds=5))
    finally:
        good.close()
        bad.close()


@pytest.mark.parametrize("args", [["--secret", S], [f"--secret={S}"]])
def test_the_lighthouse_cli_refuses_a_secret_given_on_the_command_line(args):
    out = subprocess.run(
        lighthouse_command() + ["--min-replicas", "1", "--http-bind", "", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "refusing --secret: a secret on the command line can be read by every user" in (
        out.stderr
    )
    assert "--secret-file" in out.stderr
    assert S not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        ("\n", "is empty; put the secret in it"),
        (None, "cannot read the secret file"),
    ],
)
def test_the_lighthouse_cli_exits_with_one_clear_line_on_a_bad_secret_file(
    tmp_path, content, message
):
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    out = subprocess.run(
        lighthouse_command()
        + ["--min-replicas", "1", "--http-bind", "", "--secret-file", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("torchft-lighthouse: error: ")
    assert str(path) in out.stderr and message in out.stderr
    assert "Traceback" not in out.stderr


def start_group(children, tmp_path: Path, lighthouse: str, group: int, env: dict):
    return children.spawn(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         "examples/train_ddp.py", "--steps", "15", "--hidden", "32",
         "--log-json", str(tmp_path / f"group{group}.jsonl")],
        log=tmp_path / f"group{group}.log",
        env={"TORCHFT_LIGHTHOUSE": lighthouse, "REPLICA_GROUP_ID": str(group),
             "NUM_REPLICA_GROUPS": "2", "TORCHFT_TIMEOUT_SEC": "10", **env},
    )  # fmt: skip


def test_torchrun_jobs_with_the_secret_file_train_and_one_without_is_turned_away(
    children, tmp_path, secret_file
):
    """Two groups with TORCHFT_SECRET_FILE train together to the end,
    bit-identical (at step 0 one heals from the other over the protected HTTP
    transport); a third group without the secret exits saying what to set."""
    lighthouse = start_lighthouse(children, ["--secret-file", str(secret_file)], min_replicas=2)
    with_secret = {auth.SECRET_FILE_ENV: str(secret_file)}
    groups = [start_group(children, tmp_path, lighthouse, g, with_secret) for g in range(2)]
    intruder = start_group(children, tmp_path, lighthouse, 2, {"NUM_REPLICA_GROUPS": "3"})
    assert [g.wait(timeout=90) for g in groups] == [0, 0]
    assert intruder.wait(timeout=30) != 0
    a, b = finals(tmp_path)
    assert a["step"] == b["step"] == 15 and a["hash"] == b["hash"]
    logs = [(tmp_path / f"group{g}.log").read_text() for g in range(3)]
    assert sum("healing from replica rank" in log for log in logs[:2]) == 1
    assert all("participants 2 committed True" in log for log in logs[:2])
    log = logs[2]
    assert "this lighthouse requires the job's shared secret and the request carried none" in log


HOST_MANAGER_SERVER = """
import sys, threading
from lighthouse import LighthouseServer
from torchft_like.manager.group.server import ManagerServer
secret = open(sys.argv[1]).read().strip()
lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, secret=secret)
server = ManagerServer(replica_id="g:1", lighthouse_addr=lighthouse.address(),
                       hostname="127.0.0.1", bind="127.0.0.1:0", store_addr="s:1",
                       world_size=1, secret=secret)
print("manager server on", server.address(), flush=True)
threading.Event().wait()
"""


def test_the_kill_rpc_is_refused_without_the_secret_and_obeyed_with_it(children, secret_file):
    proc = children.spawn([PYTHON, "-c", HOST_MANAGER_SERVER, str(secret_file)])
    addr = wait_for_line(proc, r"manager server on (http://\S+)", timeout=60).group(1)
    for secret, carried in [(None, "carried none"), ("wrong-secret", "carried a wrong one")]:
        client = ManagerClient(addr, secret=secret)
        try:
            with pytest.raises(QuorumError, match=carried):
                client.kill("not allowed")
        finally:
            client.close()
        assert proc.poll() is None, "the refused Kill ended the process"
    client = ManagerClient(addr, secret=S)
    try:
        client.kill("allowed")
    finally:
        client.close()
    assert proc.wait(timeout=10) == 1
