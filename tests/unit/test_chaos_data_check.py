"""The chaos runner's pure end checks: exactly-once data, and no healthy group left out as hung."""

from __future__ import annotations

import pytest

from tools.chaos.checks import (
    BatchRecord,
    FaultWindow,
    Suspicion,
    data_exactly_once,
    false_suspicions,
)


def b(group: int, step: int, epoch: int, *ids: int) -> BatchRecord:
    return BatchRecord(group, step, epoch, ids)


@pytest.mark.parametrize(
    ("batches", "problems"),
    [
        ([], []),
        # Two groups, two epochs of two batches, each group its own shard.
        (
            [b(0, 1, 0, 0, 1), b(0, 2, 0, 2, 3), b(0, 3, 1, 3, 0), b(0, 4, 1, 1, 2),
             b(1, 1, 0, 4, 5), b(1, 2, 0, 6, 7), b(1, 3, 1, 7, 4), b(1, 4, 1, 5, 6)],
            [],
        ),
        # A group that was away (steps 2-3) and heals in: its steps have gaps.
        ([b(0, 1, 0, 0, 1), b(0, 4, 1, 1, 2), b(1, 1, 0, 4, 5), b(1, 4, 1, 5, 6)], []),
        # A step trained twice (an uncommitted step's batch logged as committed).
        ([b(0, 1, 0, 0, 1), b(0, 1, 0, 2, 3)], ["group 0 trained a batch for step 1 twice"]),
        # One batch behind its step: the next epoch's first batch lands in this epoch.
        (
            [b(0, 1, 0, 0, 1), b(0, 2, 0, 2, 3), b(0, 3, 0, 3, 1)],
            ["group 0 trained sample 3 at step 3, which it trained at step 2 in the same epoch 0"],
        ),
        # A restarted group replaying its shard from the start of epoch 0.
        (
            [b(0, 3, 1, 3, 0), b(0, 5, 0, 0, 1), b(1, 5, 2, 4, 5)],
            ["group 0 went back from epoch 1 (step 3) to epoch 0 (step 5)",
             "at step 5 group 0 trained epoch 0 but group 1 epoch 2"],
        ),
        # A group reading another group's shard.
        (
            [b(0, 1, 0, 0, 1), b(1, 1, 0, 1, 4)],
            ["group 1 trained sample 1 at step 1, which group 0 trained at step 1 in the "
             "same epoch 0"],
        ),
        # The same sample in another epoch is fine.
        ([b(0, 1, 0, 0, 1), b(0, 2, 1, 0, 1)], []),
    ],
)  # fmt: skip
def test_each_batch_is_trained_once_by_the_commit_its_step_calls_for(batches, problems):
    assert data_exactly_once(batches) == problems


@pytest.mark.parametrize(
    "suspicions, faults, flagged",
    [
        ([], [], 0),
        # A stopped group suspected while stopped: right.
        ([Suspicion(10.5, 1)], [FaultWindow(1, 10.0, 12.0)], 0),
        # Within the margin after it settled (the log line came a tick late): right.
        ([Suspicion(12.8, 1)], [FaultWindow(1, 10.0, 12.0)], 0),
        # A fault on another group does not excuse it.
        ([Suspicion(10.5, 2)], [FaultWindow(1, 10.0, 12.0)], 1),
        # Long after its own fault: a healthy group left out.
        ([Suspicion(30.0, 1)], [FaultWindow(1, 10.0, 12.0)], 1),
    ],
)
def test_a_healthy_group_left_out_as_hung_fails_the_run(suspicions, faults, flagged):
    assert len(false_suspicions(suspicions, faults)) == flagged
