"""Table-driven tests of the per-rank quorum result (who heals from whom)."""

from __future__ import annotations

import pytest

from lighthouse.quorum import Quorum, QuorumMember
from torchft_like.recovery import compute_quorum_result


def quorum(steps: dict[str, int], failures: int = 0) -> Quorum:
    return Quorum(
        quorum_id=9,
        participants=tuple(
            QuorumMember(
                replica_id=rid,
                address=f"http://{rid}:1",
                store_address=f"{rid}:2",
                step=step,
                commit_failures=failures,
            )
            for rid, step in steps.items()
        ),
        created=0.0,
    )


# Columns: replica_rank, world, max_step, max_replica_rank, max_world, heal,
# src replica rank, src address, dst ranks, store of the primary.
CASES = [
    (
        "healthy steady state",
        {"a": 5, "b": 5},
        "a",
        0,
        False,
        (0, 2, 5, 0, 2, False, None, "", (), "a:2"),
    ),
    (
        "rank 1 of the group uses the next primary",
        {"a": 5, "b": 5},
        "a",
        1,
        False,
        (0, 2, 5, 0, 2, False, None, "", (), "b:2"),
    ),
    (
        "one replica behind heals",
        {"a": 5, "b": 2},
        "b",
        0,
        True,
        (1, 2, 5, None, 1, True, 0, "http://a:1", (), "a:2"),
    ),
    (
        "the up-to-date replica is the source",
        {"a": 5, "b": 2},
        "a",
        0,
        True,
        (0, 2, 5, 0, 1, False, None, "", (1,), "a:2"),
    ),
    (
        "init_sync at step 0 heals all but the primary",
        {"a": 0, "b": 0, "c": 0},
        "c",
        0,
        True,
        (2, 3, 0, 2, 3, True, 0, "http://a:1", (), "a:2"),
    ),
    (
        "init_sync at step 0: the primary sends to all",
        {"a": 0, "b": 0, "c": 0},
        "a",
        0,
        True,
        (0, 3, 0, 0, 3, False, None, "", (1, 2), "a:2"),
    ),
    (
        "no init_sync at step 0: nobody heals",
        {"a": 0, "b": 0},
        "b",
        0,
        False,
        (1, 2, 0, 1, 2, False, None, "", (), "a:2"),
    ),
    (
        "several recovering replicas spread over several sources",
        {"a": 7, "b": 7, "c": 1, "d": 3},
        "d",
        0,
        False,
        (3, 4, 7, None, 2, True, 1, "http://b:1", (), "a:2"),
    ),
    (
        "the first recovering replica takes the first source",
        {"a": 7, "b": 7, "c": 1, "d": 3},
        "a",
        0,
        False,
        (0, 4, 7, 0, 2, False, None, "", (2,), "a:2"),
    ),
    (
        "another group rank shifts the sources",
        {"a": 7, "b": 7, "c": 1, "d": 3},
        "a",
        1,
        False,
        (0, 4, 7, 0, 2, False, None, "", (3,), "b:2"),
    ),
]


@pytest.mark.parametrize("name, steps, me, group_rank, init_sync, expected", CASES)
def test_quorum_result(name, steps, me, group_rank, init_sync, expected):
    r = compute_quorum_result(quorum(steps), me, group_rank, init_sync)
    got = (
        r.replica_rank,
        r.replica_world_size,
        r.max_step,
        r.max_replica_rank,
        r.max_world_size,
        r.heal,
        r.recover_src_replica_rank,
        r.recover_src_manager_address,
        r.recover_dst_replica_ranks,
        r.store_address,
    )
    assert got == expected


def test_participants_are_ranked_by_replica_id_whatever_their_order():
    q = quorum({"c": 1, "a": 1, "b": 1})
    assert [compute_quorum_result(q, rid, 0, False).replica_rank for rid in "abc"] == [0, 1, 2]


def test_commit_failures_are_passed_on():
    assert compute_quorum_result(quorum({"a": 1}, failures=2), "a", 0, False).commit_failures == 2


def test_a_replica_outside_the_quorum_is_an_error():
    with pytest.raises(ValueError, match="replica z is not in quorum 9"):
        compute_quorum_result(quorum({"a": 1}), "z", 0, False)
