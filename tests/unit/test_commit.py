"""The commit vote's rules and who counts in a step's collectives: pure, table-tested."""

from __future__ import annotations

import pytest

from lighthouse.core.views import QuorumResult
from torchft_like.manager.commit import check_retries, rank_vote
from torchft_like.manager.heal_plan import participation


@pytest.mark.parametrize(
    "errored, healing, num_participants, expected",
    [
        (False, False, 2, (True, "")),
        (True, False, 2, (False, "")),
        (False, True, 2, (False, "")),
        (False, False, 1, (False, "too few replicas to commit: 1 < min_replica_size 2")),
        (True, False, 1, (False, "")),  # the error was logged where it happened
    ],
)
def test_a_rank_votes_yes_only_without_error_heal_or_want_of_replicas(
    errored, healing, num_participants, expected
):
    assert rank_vote(errored, healing, num_participants, min_replica_size=2) == expected


@pytest.mark.parametrize("failures, max_retries", [(5, None), (0, 0), (3, 3)])
def test_uncommitted_steps_up_to_max_retries_are_not_fatal(failures, max_retries):
    check_retries(failures, max_retries, None)


def test_one_uncommitted_step_past_max_retries_raises_naming_the_last_error():
    with pytest.raises(RuntimeError, match=r"4 steps in a row .* max_retries=3; last error: boom"):
        check_retries(4, 3, ValueError("boom"))


def result(replica_rank: int, max_replica_rank: int | None) -> QuorumResult:
    return QuorumResult(
        quorum_id=1, replica_rank=replica_rank, replica_world_size=3, store_address="s:1",
        max_step=5, max_replica_rank=max_replica_rank, max_world_size=2,
        heal=max_replica_rank is None,
    )  # fmt: skip


@pytest.mark.parametrize(
    "res, every_member_counts, max_participants, expected",
    [
        (result(1, 1), False, None, (2, 1)),  # the replicas at max_step count
        (result(2, None), False, None, (2, None)),  # behind: heals, contributes zeros
        (result(2, None), True, None, (3, 2)),  # synchronous: every member counts
        (result(1, 1), False, 1, (1, None)),  # a spare past the cap
        (result(0, 0), False, 1, (1, 0)),
        (result(2, None), True, 2, (2, None)),
    ],
)
def test_who_counts_in_the_collectives(res, every_member_counts, max_participants, expected):
    assert participation(res, every_member_counts, max_participants) == expected
