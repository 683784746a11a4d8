"""Conversion between ManagerService messages and the plain dataclasses of the logic.

Nothing past the servicer and the gRPC client sees a protobuf; the
in-process client skips this module entirely. Ranges are checked by the
server, which knows its group's size (QuorumRequest.check).
"""

from __future__ import annotations

from lighthouse.rpc.proto import torchft_pb2 as pb
from torchft_like.manager.group.group_request import QuorumRequest

__all__ = [
    "quorum_request_from_proto",
    "quorum_request_to_proto",
    "result_from_proto",
    "result_to_proto",
    "should_commit_request_from_proto",
    "should_commit_request_to_proto",
]
from lighthouse.wire import result_from_proto, result_to_proto


def quorum_request_to_proto(r: QuorumRequest) -> pb.ManagerQuorumRequest:
    return pb.ManagerQuorumRequest(
        group_rank=r.group_rank,
        step=r.step,
        checkpoint_metadata=r.checkpoint_metadata,
        shrink_only=r.shrink_only,
        init_sync=r.init_sync,
        commit_failures=r.commit_failures,
        fingerprint=r.fingerprint,
        heal_report=r.heal_report,
        batch_slot=r.batch_slot,
    )


def quorum_request_from_proto(m: pb.ManagerQuorumRequest) -> QuorumRequest:
    return QuorumRequest(
        group_rank=m.group_rank,
        step=m.step,
        checkpoint_metadata=m.checkpoint_metadata,
        shrink_only=m.shrink_only,
        init_sync=m.init_sync,
        commit_failures=m.commit_failures,
        fingerprint=m.fingerprint,
        heal_report=m.heal_report,
        batch_slot=m.batch_slot if m.HasField("batch_slot") else None,
    )


def should_commit_request_to_proto(
    group_rank: int, step: int, should_commit: bool
) -> pb.ShouldCommitRequest:
    return pb.ShouldCommitRequest(should_commit=should_commit, group_rank=group_rank, step=step)


def should_commit_request_from_proto(m: pb.ShouldCommitRequest) -> tuple[int, int, bool]:
    """(group_rank, step, vote)."""
    return m.group_rank, m.step, m.should_commit
