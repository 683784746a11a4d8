"""End to end: nobody trains from scratch by accident. A group that joins a
job past step 0 and loses the only group it could heal from (SIGKILLed)
waits, and says why in its own log, instead of training from step 0 alone
(min_replicas=1); once the dead group is back from its durable checkpoint,
it heals from it and both train on to the same end."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.e2e.test_kill_and_recover import steps
from tests.e2e.test_whole_job_restart import complete, final
from tests.procs import PYTHON, wait_for_line
from tests.waiting import wait_until
from tools.procs import kill_tree, signal_tree

pytestmark = pytest.mark.timeout(240)

STEPS = 30


def start_group(children, tmp_path: Path, g: int, address: str, name: str, *extra: str):
    return children.spawn(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         "examples/train_ddp.py", "--steps", str(STEPS), "--hidden", "64",
         "--step-sleep", "0.1", "--log-json", str(tmp_path / f"{name}.jsonl"), *extra],
        log=tmp_path / f"{name}.log",
        env={"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(g),
             "NUM_REPLICA_GROUPS": "2", "TORCHFT_TIMEOUT_SEC": "5"},
    )  # fmt: skip


def test_a_group_with_no_live_peer_waits_and_says_so_until_one_is_back(children, tmp_path):
    lighthouse = children.spawn(
        [PYTHON, "-m", "lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0",
         "--http-bind", "", "--join-timeout-ms", "1000", "--heartbeat-timeout-ms", "2000",
         "--state-file", str(tmp_path / "lighthouse.json")],
    )  # fmt: skip
    address = wait_for_line(lighthouse, r"listening on (http://\S+)", timeout=15).group(1)
    ckpt = tmp_path / "ckpt"
    source = start_group(children, tmp_path, 0, address, "source", "--checkpoint-dir", str(ckpt),
                         "--checkpoint-every", "5")  # fmt: skip
    wait_until(
        lambda: complete(ckpt, 10) and max(
            (r["step"] for r in steps(tmp_path / "source.jsonl")), default=0) >= 12,
        120, "group 0 at step 12 with a checkpoint of step 10",
    )  # fmt: skip
    # Group 0 stopped, then killed once group 1 is up: group 1 never gets a
    # byte of the job's state, and no live group holds it.
    signal_tree(source.pid, signal.SIGSTOP)
    joiner = start_group(children, tmp_path, 1, address, "joiner")
    log = tmp_path / "joiner.log"
    wait_until(lambda: "manager ready" in log.read_text(errors="replace"), 90, "group 1 up")
    assert not kill_tree(source.pid), "group 0 survived SIGKILL"

    wait_until(
        lambda: "refusing to train from step 0" in log.read_text(errors="replace"),
        30, "group 1 to say why it waits",
    )  # fmt: skip
    said = log.read_text(errors="replace")
    assert "not training, waiting" in said and "--allow-fresh-start" in said
    assert "durable checkpoint" in said
    # The mark: the highest step a member reported in a quorum (the commit of
    # that quorum's step is group 0's last, unseen by the lighthouse).
    mark = re.search(r"already committed step (\d+)", said)
    assert mark is not None and int(mark.group(1)) >= 11
    assert not [r for r in steps(tmp_path / "joiner.jsonl") if r["committed"]], (
        "group 1 trained from step 0 on fresh weights"
    )
    assert joiner.poll() is None, "group 1 gave up instead of waiting"

    # Group 0 comes back from its durable checkpoint (below the mark, past 0):
    # group 1 heals from it and both train on.
    resumed = start_group(children, tmp_path, 0, address, "resumed", "--checkpoint-dir",
                          str(ckpt), "--checkpoint-every", "5")  # fmt: skip
    assert resumed.wait(timeout=120) == 0 and joiner.wait(timeout=60) == 0
    first = [r for r in steps(tmp_path / "joiner.jsonl") if r["committed"]][0]
    assert first["step"] > 10, f"group 1's first committed step was {first['step']}"
    assert final(tmp_path / "resumed.jsonl")["hash"] == final(tmp_path / "joiner.jsonl")["hash"]
