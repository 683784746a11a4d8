"""Which ManagerService.Quorum calls a ManagerServer lets into its group's round.

Without a shared secret anyone who reaches a ManagerServer can call Quorum
as any rank of its group. One call claiming a far-ahead step made every
group try to heal from this one (and stall for the heal timeout); calls in a
rank's name at the current step took that rank's place in the round, so the
real rank's call opened a round nobody else joined, and the group failed
step after step. The rule here makes such a call cost the job nothing:

- A rank's own calls carry its checkpoint metadata (the address its peers
  heal from, fixed for the rank's lifetime), so a call with the metadata the
  rank's earlier rounds registered is *trusted*; the first call of a rank
  is trusted too (nothing is known yet).
- A call that is not trusted may wait in an empty slot, but it completes a
  round only after UNTRUSTED_HOLD_S with no trusted call for its rank (a
  rank whose process really restarted alone still gets in); the rank's own
  call takes the slot from it at once.
- A call that is not trusted and claims a step past the group's last
  quorum's max step + 1 (no rank can be further ahead) is refused at once.
- A second caller for a rank that already has a call waiting is refused at
  once, unless it is trusted and the waiting one is not.

A caller that copies a rank's metadata (CheckpointMetadata serves it) is not
stopped; a shared secret (lighthouse.rpc.auth) stops every forged call.
Pure: tested as a table (tests/unit/test_quorum_admission.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from lighthouse.rpc.errors import QuorumError

UNTRUSTED_HOLD_S = 5.0
"""How long a round that is complete but for untrusted calls waits for the
ranks' own calls before it goes on with them. A rank's own call comes within
a step's skew of the others'; an untrusted one that would win later is a
rank that restarted alone, which pays this once."""


@dataclass(frozen=True)
class Admission:
    """The verdict on one call."""

    error: Exception | None = None
    """The caller's refusal (then nothing else applies)."""
    trusted: bool = True
    """The call counts toward completing the round at once."""
    displaced: Exception | None = None
    """The call waiting for the same rank ends with this; the new one takes its place."""


def admit(
    group_rank: int,
    step: int,
    metadata: str,
    known_metadata: str | None,
    waiting_metadata: str | None,
    last_max_step: int | None,
) -> Admission:
    """The verdict on a Quorum call of `group_rank` at `step` with `metadata`.

    Args:
        known_metadata: the metadata the rank's earlier rounds registered, or
            None before its first.
        waiting_metadata: the metadata of the call already waiting for this
            rank in the round, or None when its slot is empty.
        last_max_step: the highest step in the group's last quorum, or None
            before its first.
    """
    trusted = known_metadata is None or metadata == known_metadata
    if not trusted and last_max_step is not None and step > last_max_step + 1:
        return Admission(
            error=ValueError(
                f"group rank {group_rank} asked for a quorum at step {step}, past this group's "
                f"last quorum (max step {last_max_step}; no rank can be more than one step "
                "ahead of it) and with checkpoint metadata that is not the rank's: refused as a "
                "stray or forged call; the group trains on"
            )
        )
    if waiting_metadata is None:
        return Admission(trusted=trusted)
    if trusted and waiting_metadata != known_metadata:
        return Admission(
            trusted=True,
            displaced=QuorumError(
                f"group rank {group_rank}'s own call (its checkpoint metadata) came: this call, "
                "whose metadata is not the rank's, gives way as a stray or forged call"
            ),
        )
    return Admission(
        error=QuorumError(
            f"group rank {group_rank} already has a Quorum call waiting in this round: refusing "
            "a second caller (a stray or forged call, or a retry while the first still waits); "
            "the waiting call goes on"
        )
    )
