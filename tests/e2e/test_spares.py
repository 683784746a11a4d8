"""End to end: hot spares with no operator. Real torchrun groups started with
--spare, one spare, real SIGKILL: the lighthouse hands the dead group's place
to the spare; the dead group's restart finds its place taken, waits as the
next spare, and takes the place of the next group that dies."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.test_kill_and_recover import last_step, start_lighthouse, steps
from tests.procs import PYTHON
from tests.waiting import wait_until
from tools.procs import kill_tree, read_jsonl

pytestmark = pytest.mark.timeout(180)


def start(children, tmp_path: Path, lighthouse: str, name: str, group: int | None):
    env = {"TORCHFT_LIGHTHOUSE": lighthouse, "NUM_REPLICA_GROUPS": "2", "TORCHFT_TIMEOUT_SEC": "5"}
    if group is not None:
        env["REPLICA_GROUP_ID"] = str(group)
    return children.spawn(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         "examples/train_ddp.py", "--steps", "100000", "--hidden", "32", "--spare",
         "--stop-file", str(tmp_path / "stop"), "--step-sleep", "0.05",
         "--log-json", str(tmp_path / f"{name}.jsonl")],
        log=tmp_path / f"{name}.log",
        env=env,
    )  # fmt: skip


def committed_after(path: Path, t: float) -> bool:
    return any(r["t"] > t and r["committed"] for r in steps(path))


def test_spares_take_the_places_of_dead_groups_without_an_operator(children, tmp_path):
    lighthouse = start_lighthouse(children, heartbeat_timeout_ms=1000)
    group0 = start(children, tmp_path, lighthouse, "a", 0)
    group1 = start(children, tmp_path, lighthouse, "b", 1)
    start(children, tmp_path, lighthouse, "spare", None)
    log = {name: tmp_path / f"{name}.jsonl" for name in ("a", "b", "spare", "b2")}
    wait_until(
        lambda: (
            min(last_step(log["a"]), last_step(log["b"])) >= 10
            and b"spare: ready" in (tmp_path / "spare.log").read_bytes()
        ),
        90,
        "both groups to train and the spare to wait",
    )

    assert not kill_tree(group1.pid)
    killed_at = time.time()
    wait_until(lambda: committed_after(log["spare"], killed_at), 30, "the spare to commit")
    took_over = next(r for r in read_jsonl(log["spare"]) if r["event"] == "start")
    assert took_over["replica_id"].startswith("train_ddp_1:")

    # Group 1's restart finds its place taken: it waits as the next spare.
    start(children, tmp_path, lighthouse, "b2", 1)
    wait_until(
        lambda: b"spare: ready" in (tmp_path / "b2.log").read_bytes(), 60, "the restart to wait"
    )
    time.sleep(0.5)
    assert not steps(log["b2"]), "the restart trained as a twin of the spare"

    assert not kill_tree(group0.pid)
    killed_at = time.time()
    wait_until(lambda: committed_after(log["b2"], killed_at), 30, "the restart to take group 0")
    restarted = next(r for r in read_jsonl(log["b2"]) if r["event"] == "start")
    assert restarted["replica_id"].startswith("train_ddp_0:")

    final = max(last_step(log["spare"]), last_step(log["b2"])) + 10
    (tmp_path / "stop.tmp").write_text(str(final))
    (tmp_path / "stop.tmp").rename(tmp_path / "stop")
    wait_until(
        lambda: all(
            any(r["event"] == "final" for r in read_jsonl(log[n])) for n in ("spare", "b2")
        ),
        60,
        "both live groups to finish",
    )
    a, b = (next(r for r in read_jsonl(log[n]) if r["event"] == "final") for n in ("spare", "b2"))
    assert a["step"] == b["step"] == final
    assert a["hash"] == b["hash"], "the two live groups are not bit-identical"
