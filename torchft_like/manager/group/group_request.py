"""How the per-rank quorum requests of one replica group become its one lighthouse request.

Pure: the ManagerServer gathers a request from every rank of its group, and
this rule decides what the group as a whole tells the lighthouse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lighthouse.core.member_data import group_data
from lighthouse.core.quorum import QuorumMember


@dataclass(frozen=True)
class QuorumRequest:
    """One rank's request for the next quorum (ManagerQuorumRequest)."""

    group_rank: int
    step: int
    """Committed steps of this rank."""
    checkpoint_metadata: str = ""
    """How a healing peer fetches this rank's state (the transport's metadata)."""
    shrink_only: bool = False
    init_sync: bool = True
    commit_failures: int = 0
    """Steps in a row this rank failed to commit."""
    fingerprint: str = ""
    """State fingerprint after `step` commits, or empty (see Manager fingerprint_interval)."""
    heal_report: str = ""
    """JSON of the heal this rank finished last step, or empty
    (lighthouse.core.member_data.rank_heal_report)."""
    batch_slot: int | None = None
    """The participating rank this rank predicted when it took its batch
    (torchft_like.StepBatches), -1 for none; None: no batch claimed."""

    def check(self, world_size: int) -> None:
        """Raises ValueError naming the first field out of range for a group of `world_size`."""
        if not 0 <= self.group_rank < world_size:
            raise ValueError(f"group_rank ({self.group_rank}) must be in [0, {world_size})")
        for name in ("step", "commit_failures"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must not be negative")


@dataclass(frozen=True)
class GroupRequest:
    """What the group asks of the lighthouse, and what it decides locally."""

    member: QuorumMember
    init_sync: bool


def merge_requests(
    requests: Mapping[int, QuorumRequest],
    replica_id: str,
    address: str,
    store_address: str,
    world_size: int,
    local_collectives: bool = False,
) -> GroupRequest:
    """The group's request from every rank's (keyed by group rank).

    The rule: the group reports its furthest rank's step (ranks of a group
    commit together, so they differ only when one restarted); one rank
    asking shrink_only or init_sync asks it for the group; the group reports
    its worst commit_failures, so a failure on any rank moves the quorum id
    on; fingerprints travel only from the ranks at the group's step, since
    only those compare with other groups' states; the ranks' heal reports
    travel merged for the status page. A group whose process group never
    talks to other groups (`local_collectives`) says so, for
    lighthouse.core.compat. The group's batch slot is its ranks' common claim,
    -1 when they differ (their batches then cannot all be the quorum's).
    All of these travel in `QuorumMember.data` (lighthouse.core.member_data).

    Raises:
        ValueError: `requests` is empty.
    """
    if not requests:
        raise ValueError("a group request needs at least one rank's request")
    step = max(r.step for r in requests.values())
    data = group_data(
        step=step,
        fingerprints={g: r.fingerprint for g, r in requests.items() if r.step == step},
        world_size=world_size,
        heal_reports=[r.heal_report for r in requests.values()],
        local_rendezvous=local_collectives,
        batch_slot=_group_slot([r.batch_slot for r in requests.values()]),
    )
    member = QuorumMember(
        replica_id=replica_id,
        address=address,
        store_address=store_address,
        step=step,
        world_size=world_size,
        shrink_only=any(r.shrink_only for r in requests.values()),
        data=data,
        commit_failures=max(r.commit_failures for r in requests.values()),
    )
    return GroupRequest(member=member, init_sync=any(r.init_sync for r in requests.values()))


def _group_slot(claims: list[int | None]) -> int | None:
    """One claim for the group: None when no rank claims, the claim when all
    agree, else -1 (a rank that claims nothing, or another slot, took a
    batch the quorum does not give the group)."""
    if all(c is None for c in claims):
        return None
    return claims[0] if all(c == claims[0] for c in claims) else -1
