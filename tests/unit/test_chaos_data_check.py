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


def b(group, step, qid, committed, rank, participants, cursor, unit=None, epoch=0, ids=()):
    unit = cursor + rank if unit is None else unit
    return BatchRecord(group, step, qid, committed, rank, participants, cursor, unit, epoch,
                       tuple(ids))  # fmt: skip


@pytest.mark.parametrize(
    ("batches", "problems"),
    [
        ([], []),
        # Two groups, three steps: units 0-5, each once.
        (
            [b(0, 0, 1, True, 0, 2, 0, ids=(0, 1)), b(1, 0, 1, True, 1, 2, 0, ids=(2, 3)),
             b(0, 1, 1, True, 0, 2, 2), b(1, 1, 1, True, 1, 2, 2),
             b(0, 2, 1, True, 0, 2, 4), b(1, 2, 1, True, 1, 2, 4)],
            [],
        ),
        # A step nobody committed is not in the history; its retry is.
        (
            [b(0, 0, 1, True, 0, 2, 0), b(1, 0, 1, True, 1, 2, 0),
             b(0, 1, 1, False, 0, 2, 2, unit=3), b(1, 1, 1, False, 1, 2, 2, unit=4),
             b(0, 1, 2, True, 0, 2, 2), b(1, 1, 2, True, 1, 2, 2)],
            [],
        ),
        # Group 1 failed its vote but group 0 committed: its unit was trained.
        ([b(0, 0, 1, True, 0, 2, 0), b(1, 0, 1, False, 1, 2, 0), b(0, 1, 2, True, 0, 1, 2)], []),
        # Group 1 alone after group 0 committed step 1 and died: the later quorum's step 1 counts.
        (
            [b(0, 0, 1, True, 0, 2, 0), b(1, 0, 1, True, 1, 2, 0),
             b(0, 1, 1, True, 0, 2, 2), b(1, 1, 1, False, 1, 2, 2),
             b(1, 1, 3, True, 0, 1, 2)],
            [],
        ),
        # A participant that trained another unit than the quorum gave it.
        (
            [b(0, 0, 1, True, 0, 2, 0), b(1, 0, 1, True, 1, 2, 0, unit=0)],
            ["group 1 trained unit 0 at step 0, but as participant 1 the quorum gave it unit 1"],
        ),
        # A cursor that jumps (units skipped) or goes back (units trained twice).
        (
            [b(0, 0, 1, True, 0, 1, 0), b(0, 1, 1, True, 0, 1, 3), b(0, 2, 1, True, 0, 1, 2)],
            ["step 1 began at unit 3: units 1-2 never trained",
             "step 2 began at unit 2: units 2-3 trained twice"],
        ),
        # Groups that disagree on where the step began.
        (
            [b(0, 0, 1, True, 0, 2, 0), b(1, 0, 1, True, 1, 2, 1)],
            ["step 0: groups disagree on the cursor or the participants"],
        ),
        # The same sample twice in one epoch; in another epoch it is fine.
        (
            [b(0, 0, 1, True, 0, 1, 0, ids=(5, 6)), b(0, 1, 1, True, 0, 1, 1, ids=(6, 7)),
             b(0, 2, 1, True, 0, 1, 2, epoch=1, ids=(5,))],
            ["sample 6 trained at steps 0 and 1 of epoch 0"],
        ),
    ],
)  # fmt: skip
def test_each_unit_is_trained_in_exactly_one_step_of_the_history(batches, problems):
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
