"""The rules of one rank's commit vote: what it votes, and when to give up.

Apart from rank.py (the Manager's step machine) so that the rules are pure and table-tested; the
Manager gathers the step's facts (an error, the participants, a heal not
applied), asks the group's ManagerServer for the decision and keeps the
counters.
"""

from __future__ import annotations


def rank_vote(
    errored: bool, healing: bool, num_participants: int, min_replica_size: int
) -> tuple[bool, str]:
    """This rank's vote, and the reason to log when it is no for want of
    replicas ("" otherwise: an error or a heal was logged where it happened).

    Yes only without an error, with at least `min_replica_size`
    participants, and with no healed state left unapplied.
    """
    enough = num_participants >= min_replica_size
    reason = (
        ""
        if errored or enough
        else f"too few replicas to commit: {num_participants} < min_replica_size {min_replica_size}"
    )
    return not errored and enough and not healing, reason


def check_retries(
    commit_failures: int, max_retries: int | None, last_error: Exception | None
) -> None:
    """Raises RuntimeError once more than `max_retries` steps in a row
    failed to commit (None: never)."""
    if max_retries is not None and commit_failures > max_retries:
        raise RuntimeError(
            f"{commit_failures} steps in a row failed to commit, more than "
            f"max_retries={max_retries}; last error: {last_error}"
        )
