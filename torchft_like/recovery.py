"""Per-rank view of a quorum: our rank, the primary store, who heals from whom.

A pure function of (quorum, replica_id, group_rank, init_sync), so every
ManagerServer derives the same assignment without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from lighthouse.quorum import Quorum, QuorumMember


@dataclass(frozen=True)
class QuorumResult:
    """What one rank of one replica group needs to know about a quorum."""

    quorum_id: int
    replica_rank: int
    """Our index among the participants, sorted by replica_id."""
    replica_world_size: int
    store_address: str
    """TCPStore of the primary for our group rank: where the process group meets."""
    max_step: int
    max_replica_rank: int | None
    """Our index among the participants at max_step, or None if we are behind."""
    max_world_size: int
    heal: bool
    """We must copy the state from `recover_src_*` before stepping."""
    recover_src_manager_address: str = ""
    recover_src_replica_rank: int | None = None
    recover_dst_replica_ranks: tuple[int, ...] = ()
    commit_failures: int = 0


def compute_quorum_result(
    quorum: Quorum, replica_id: str, group_rank: int, init_sync: bool
) -> QuorumResult:
    """Follows DESIGN.md "One training step", point 2.

    Sources are spread: the i-th recovering replica copies from up-to-date
    replica (i + group_rank) mod (number up to date), so recoveries of several
    replicas, and of the ranks of one group, do not all load one peer.

    Raises:
        ValueError: `replica_id` is not a participant of `quorum`.
    """
    participants = sorted(quorum.participants, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in participants]
    if replica_id not in ids:
        raise ValueError(f"replica {replica_id} is not in quorum {quorum.quorum_id} ({ids})")
    replica_rank = ids.index(replica_id)
    max_step = max(m.step for m in participants)
    at_max = [m for m in participants if m.step == max_step]
    at_max_ids = [m.replica_id for m in at_max]
    primary = at_max[group_rank % len(at_max)]

    recovering = [m for m in participants if m.step != max_step]
    if init_sync and max_step == 0:
        recovering = [m for m in participants if m.replica_id != primary.replica_id]
    recovering_ids = {m.replica_id for m in recovering}
    up_to_date = [m for m in at_max if m.replica_id not in recovering_ids]

    def source_of(i: int) -> QuorumMember:
        return up_to_date[(i + group_rank) % len(up_to_date)]

    src: QuorumMember | None = None
    for i, member in enumerate(recovering):
        if member.replica_id == replica_id:
            src = source_of(i)
    dst = tuple(
        ids.index(m.replica_id)
        for i, m in enumerate(recovering)
        if source_of(i).replica_id == replica_id
    )
    return QuorumResult(
        quorum_id=quorum.quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(participants),
        store_address=primary.store_address,
        max_step=max_step,
        max_replica_rank=at_max_ids.index(replica_id) if replica_id in at_max_ids else None,
        max_world_size=len(at_max),
        heal=src is not None,
        recover_src_manager_address=src.address if src else "",
        recover_src_replica_rank=ids.index(src.replica_id) if src else None,
        recover_dst_replica_ranks=dst,
        commit_failures=max(m.commit_failures for m in participants),
    )
