"""Ray Train's TorchTrainer with TorchftConfig on torchft_like, unmodified
torchft code, a worker failure, the replacement healing: examples/ray_train.py
as a user runs it (opt-in: scripts/integration.sh)."""

from __future__ import annotations

import re

import pytest

from tests.procs import PYTHON, REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
pytest.importorskip("ray.train", reason="Ray Train is not installed: run scripts/integration.sh")


def test_a_failed_worker_is_replaced_heals_from_a_survivor_and_ends_identical(children, tmp_path):
    log = tmp_path / "ray.log"
    proc = children.spawn(
        [PYTHON, str(REPO / "examples" / "ray_train.py"), "--workers", "3", "--steps", "150",
         "--fail-at", "20", "--step-sleep", "0.1", "--out", str(tmp_path / "out")],
        log=log,
    )  # fmt: skip
    rc = proc.wait(timeout=540)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-6000:]
    assert "replicas identical: yes" in text
    assert "injected failure of group 0 at step" in text
    # Groups that start while another trains join (heal) within a few steps:
    # every group but the first heals before the failure at step 20, by step 10.
    joins: dict[int, int] = {}
    for g, s in re.findall(r"group (\d+): healed at step (\d+)", text):
        if int(s) < 20:
            joins[int(g)] = min(joins.get(int(g), int(s)), int(s))
    assert len(joins) >= 2 and max(joins.values()) <= 10, f"first heals (group: step): {joins}"
    healed = [int(s) for s in re.findall(r"group 0: healed at step (\d+)", text)]
    assert healed and max(healed) >= 20, "the replacement did not heal at the live step"
    assert "healed: loaded the live state" in text  # torchft_like's Manager did the work
