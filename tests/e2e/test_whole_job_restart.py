"""End to end: durable checkpoints. Every group and the lighthouse are
SIGKILLed at once (a power cut); started again, the job resumes from the
newest complete checkpoint and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.test_kill_and_recover import steps, unit_samples
from tests.procs import PYTHON, wait_for_line
from tests.waiting import wait_until
from tools.procs import kill_tree, read_jsonl

pytestmark = pytest.mark.timeout(240)

STEPS, EVERY = 40, 10


def start_job(children, tmp_path: Path, name: str, checkpoints: Path) -> list:
    """A lighthouse that waits for both groups (every step has both, so the
    run is deterministic) and two single-rank groups."""
    lighthouse = children.spawn(
        [PYTHON, "-m", "lighthouse", "--min-replicas", "2", "--bind", "127.0.0.1:0",
         "--http-bind", "", "--join-timeout-ms", "1000"]
    )  # fmt: skip
    address = wait_for_line(lighthouse, r"listening on (http://\S+)", timeout=15).group(1)
    groups = [
        children.spawn(
            [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
             "examples/train_ddp.py", "--steps", str(STEPS), "--hidden", "64",
             "--step-sleep", "0.05", "--checkpoint-dir", str(checkpoints),
             "--checkpoint-every", str(EVERY), "--log-json", str(tmp_path / f"{name}{g}.jsonl")],
            log=tmp_path / f"{name}{g}.log",
            env={"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(g),
                 "NUM_REPLICA_GROUPS": "2", "TORCHFT_TIMEOUT_SEC": "5"},
        )
        for g in (0, 1)
    ]  # fmt: skip
    return [lighthouse, *groups]


def final(path: Path) -> dict:
    return next(r for r in read_jsonl(path) if r["event"] == "final")


def complete(checkpoints: Path, step: int) -> bool:
    return (checkpoints / f"step_{step:09d}" / "rank_0" / "COMPLETE").exists()


def test_a_whole_job_killed_at_once_resumes_from_its_checkpoint_bit_identical(children, tmp_path):
    reference_dir = tmp_path / "reference_ckpt"
    for proc in start_job(children, tmp_path, "reference", reference_dir)[1:]:
        assert proc.wait(timeout=120) == 0
    reference = [final(tmp_path / f"reference{g}.jsonl") for g in (0, 1)]
    assert reference[0]["hash"] == reference[1]["hash"]
    # One writer per piece of state: one part per kept step, the last two kept.
    assert sorted(p.name for p in reference_dir.iterdir()) == ["step_000000030", "step_000000040"]
    assert [p.name for p in (reference_dir / "step_000000040").iterdir()] == ["rank_0"]
    logs = "".join((tmp_path / f"reference{g}.log").read_text() for g in (0, 1))
    for step in (10, 20, 30, 40):
        assert logs.count(f"checkpoint of step {step} written") == 1, "not exactly one writer"

    checkpoints = tmp_path / "ckpt"
    job = start_job(children, tmp_path, "first", checkpoints)
    wait_until(
        lambda: complete(checkpoints, 20) and max((r["step"] for r in steps(
            tmp_path / "first0.jsonl")), default=0) >= 25,
        90, "a checkpoint at step 20 and step 25",
    )  # fmt: skip
    for proc in job:  # all at once, lighthouse included
        assert not kill_tree(proc.pid), "processes survived SIGKILL"
    killed_at = time.time()
    newest = max(s for s in (10, 20, 30) if complete(checkpoints, s))

    for proc in start_job(children, tmp_path, "second", checkpoints)[1:]:
        assert proc.wait(timeout=120) == 0
    for g in (0, 1):
        resumed = [r for r in steps(tmp_path / f"second{g}.jsonl") if r["committed"]]
        assert resumed[0]["t"] > killed_at
        assert resumed[0]["step"] == newest + 1, "did not resume from the newest checkpoint"
        for r in resumed:  # the data goes on at the checkpoint's cursor
            assert (r["data_cursor"], r["data_unit"]) == (2 * r["step"] - 2, 2 * r["step"] - 2 + g)
            assert r["sample_ids"] == unit_samples(r["data_unit"])
        assert final(tmp_path / f"second{g}.jsonl")["hash"] == reference[0]["hash"], (
            f"group {g} ended different from the uninterrupted run"
        )
