"""What the lighthouse and its clients exchange about a quorum: a member as
it presents itself, and an issued quorum. Plain values, imported by the
rule (lighthouse.core.quorum), the compatibility check (lighthouse.core.compat), the
wire conversions and both sides' clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class QuorumMember:
    """One replica group as it presents itself to the lighthouse.

    Args:
        replica_id: `{name}:{uuid}`; a restarted process is a new member.
        address: URL of the group's ManagerServer, e.g. `http://host:port`.
        store_address: `host:port` of the group's TCPStore, for the
            cross-group rendezvous.
        step: the group's committed steps.
        world_size: ranks in the group.
        shrink_only: the group asks for a quorum of previous members only.
        data: free-form JSON the member shares with the others: the JSON text
            inside the lighthouse and on the wire; `LighthouseClient.quorum`
            hands it out decoded (a dict, or None when empty), as
            pytorch/torchft does.
        commit_failures: the group's failed commits in a row.
        unknown_fields: the member's fields this lighthouse does not know
            (newer torchft adds some, e.g. `reconfigure_handles`), serialized
            and opaque; put back unchanged when the member is sent on.
    """

    replica_id: str
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 1
    shrink_only: bool = False
    data: str | dict[str, Any] | None = ""
    commit_failures: int = 0
    unknown_fields: bytes = b""


@dataclass(frozen=True)
class Quorum:
    """The members that train the next step together.

    Args:
        quorum_id: changes whenever the members (or a commit failure) change.
        participants: the members, sorted by replica_id.
        created: wall-clock time of issue, seconds since the epoch.
    """

    quorum_id: int
    participants: tuple[QuorumMember, ...]
    created: float

    def replica_ids(self) -> tuple[str, ...]:
        """Computed once: a decision asks several times (O(members) each)."""
        ids = self.__dict__.get("_replica_ids")
        if ids is None:
            ids = tuple(m.replica_id for m in self.participants)
            object.__setattr__(self, "_replica_ids", ids)
        return ids
