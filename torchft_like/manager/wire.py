"""Conversion between ManagerService messages and the plain dataclasses of the logic.

Nothing past the servicer and the gRPC client sees a protobuf; the
in-process client skips this module entirely. Ranges are checked by the
server, which knows its group's size (QuorumRequest.check).
"""

from __future__ import annotations

from lighthouse.rpc.proto import torchft_pb2 as pb
from torchft_like.manager.group_request import QuorumRequest
from torchft_like.recovery import QuorumResult


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


def result_to_proto(r: QuorumResult) -> pb.ManagerQuorumResponse:
    return pb.ManagerQuorumResponse(
        quorum_id=r.quorum_id,
        recover_src_manager_address=r.recover_src_manager_address,
        recover_src_replica_rank=r.recover_src_replica_rank,
        recover_dst_replica_ranks=r.recover_dst_replica_ranks,
        store_address=r.store_address,
        max_step=r.max_step,
        max_replica_rank=r.max_replica_rank,
        max_world_size=r.max_world_size,
        replica_rank=r.replica_rank,
        replica_world_size=r.replica_world_size,
        heal=r.heal,
        commit_failures=r.commit_failures,
        recover_src_replica_ranks=r.recover_src_replica_ranks,
        recover_src_manager_addresses=r.recover_src_manager_addresses,
        recover_stripe_dst_replica_ranks=r.recover_stripe_dst_replica_ranks,
        batch_slots_wrong=r.batch_slots_wrong,
        batch_slots_wrong_all=r.batch_slots_wrong_all,
    )


def result_from_proto(m: pb.ManagerQuorumResponse) -> QuorumResult:
    return QuorumResult(
        quorum_id=m.quorum_id,
        replica_rank=m.replica_rank,
        replica_world_size=m.replica_world_size,
        store_address=m.store_address,
        max_step=m.max_step,
        max_replica_rank=m.max_replica_rank if m.HasField("max_replica_rank") else None,
        max_world_size=m.max_world_size,
        heal=m.heal,
        recover_src_manager_address=m.recover_src_manager_address,
        recover_src_replica_rank=(
            m.recover_src_replica_rank if m.HasField("recover_src_replica_rank") else None
        ),
        recover_dst_replica_ranks=tuple(m.recover_dst_replica_ranks),
        recover_src_replica_ranks=tuple(m.recover_src_replica_ranks),
        recover_src_manager_addresses=tuple(m.recover_src_manager_addresses),
        recover_stripe_dst_replica_ranks=tuple(m.recover_stripe_dst_replica_ranks),
        commit_failures=m.commit_failures,
        batch_slots_wrong=m.batch_slots_wrong,
        batch_slots_wrong_all=m.batch_slots_wrong_all,
    )


def should_commit_request_to_proto(
    group_rank: int, step: int, should_commit: bool
) -> pb.ShouldCommitRequest:
    return pb.ShouldCommitRequest(should_commit=should_commit, group_rank=group_rank, step=step)


def should_commit_request_from_proto(m: pb.ShouldCommitRequest) -> tuple[int, int, bool]:
    """(group_rank, step, vote)."""
    return m.group_rank, m.step, m.should_commit
