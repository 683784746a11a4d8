"""Conversion between protobuf messages and the plain dataclasses of the logic.

Pure code never sees a protobuf object; servicers and clients convert here,
and bad input is turned into a ValueError naming the field.
"""

from __future__ import annotations

import json

from google.protobuf.timestamp_pb2 import Timestamp
from google.protobuf.unknown_fields import UnknownFieldSet

from lighthouse.core.quorum import Quorum, QuorumMember
from lighthouse.core.views import MAX_VIEW_RANKS, QuorumResult, QuorumViews
from lighthouse.rpc.proto import torchft_pb2 as pb


def member_from_proto(msg: pb.QuorumMember) -> QuorumMember:
    if not msg.replica_id:
        raise ValueError("requester.replica_id must be a non-empty string")
    if msg.step < 0:
        raise ValueError(f"requester.step ({msg.step}) must not be negative")
    if msg.commit_failures < 0:
        raise ValueError(f"requester.commit_failures ({msg.commit_failures}) must not be negative")
    return QuorumMember(
        replica_id=msg.replica_id,
        address=msg.address,
        store_address=msg.store_address,
        step=msg.step,
        world_size=msg.world_size,
        shrink_only=msg.shrink_only,
        data=msg.data,
        commit_failures=msg.commit_failures,
        unknown_fields=_unknown_fields(msg),
    )


def _unknown_fields(msg: pb.QuorumMember) -> bytes:
    """The serialized fields of `msg` that our proto does not declare.

    A copy with every declared field cleared serializes to exactly its
    unknown fields, in the order they arrived. Most members have none, and
    counting them costs a twentieth of the copy.
    """
    if not len(UnknownFieldSet(msg)):
        return b""
    rest = pb.QuorumMember()
    rest.CopyFrom(msg)
    for field in rest.DESCRIPTOR.fields:
        rest.ClearField(field.name)
    return rest.SerializeToString()


def encode_data(data: object) -> str:
    """QuorumMember.data as it travels: JSON text (a dict is encoded, None is "")."""
    if data is None:
        return ""
    return data if isinstance(data, str) else json.dumps(data)


def decode_data(text: str) -> object:
    """QuorumMember.data as pytorch/torchft's client returns it: the decoded
    JSON, None when empty. Text that is not JSON (a peer free to send
    anything) comes back as it is rather than failing the whole quorum."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def member_to_proto(member: QuorumMember) -> pb.QuorumMember:
    msg = pb.QuorumMember(
        replica_id=member.replica_id,
        address=member.address,
        store_address=member.store_address,
        step=member.step,
        world_size=member.world_size,
        shrink_only=member.shrink_only,
        data=encode_data(member.data),
        commit_failures=member.commit_failures,
    )
    if member.unknown_fields:
        # Parsed as unknown fields again, so they serialize after ours,
        # where a sender that numbers its fields in order put them.
        msg.MergeFromString(member.unknown_fields)
    return msg


def quorum_to_proto(quorum: Quorum) -> pb.Quorum:
    created = Timestamp()
    created.FromNanoseconds(int(quorum.created * 1e9))
    return pb.Quorum(
        quorum_id=quorum.quorum_id,
        participants=[member_to_proto(m) for m in quorum.participants],
        created=created,
    )


def quorum_from_proto(msg: pb.Quorum) -> Quorum:
    return Quorum(
        quorum_id=msg.quorum_id,
        participants=tuple(member_from_proto(m) for m in msg.participants),
        created=msg.created.ToNanoseconds() / 1e9,
    )


def quorum_request_from_proto(msg: pb.LighthouseQuorumRequest) -> QuorumMember:
    if not msg.HasField("requester"):
        raise ValueError("requester is missing from the Quorum request")
    return member_from_proto(msg.requester)


def result_to_proto(r: QuorumResult, divergence: bool = False) -> pb.ManagerQuorumResponse:
    """`divergence`: include its reason (a lighthouse's view; a rank never gets it)."""
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
        divergence=r.divergence if divergence else "",
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
        divergence=m.divergence,
    )


Viewer = tuple[str, int, bool]
"""A Quorum caller that asked for its view: replica id, world size, init_sync."""


def viewer_from_proto(msg: pb.LighthouseQuorumRequest, member: QuorumMember) -> Viewer | None:
    """Who asked for its view, or None for a caller that wants every member.

    Raises:
        ValueError: a view for a world_size of 0 or past MAX_VIEW_RANKS.
    """
    if not msg.HasField("view"):
        return None
    if not 1 <= member.world_size <= MAX_VIEW_RANKS:
        raise ValueError(
            f"a view is answered for a world_size in [1, {MAX_VIEW_RANKS}], not {member.world_size}"
        )
    return member.replica_id, member.world_size, msg.view.init_sync


def view_response(views: QuorumViews, replica_id: str, world_size: int, init_sync: bool) -> bytes:
    """The answer to a requester that asked for its view: the quorum's id
    and time without members, and each of its group ranks' share.

    An up-to-date member's share differs from every other's only in its two
    ranks (QuorumViews.steady_for): that part is serialized once per quorum and
    group rank, and each answer appends its ranks (protobuf merges
    concatenated messages), ~1 us a rank where building the message is ~7.
    A member steady at every group rank (the usual step) has the same two
    ranks in each: its answer is the quorum's framed shares joined by them,
    ~2 us for 8 group ranks."""
    memo = views.memo
    header = memo.get("header")
    if not isinstance(header, bytes):
        quorum = pb.Quorum(quorum_id=views.quorum.quorum_id)
        quorum.created.FromNanoseconds(int(views.quorum.created * 1e9))
        header = memo["header"] = pb.LighthouseQuorumResponse(quorum=quorum).SerializeToString()
    if replica_id in views.steady_everywhere(world_size, init_sync):
        rank, max_rank = views.ranks(replica_id, 0, init_sync)
        ranks = _RANK + _varint(rank) + _MAX_RANK + _varint(max_rank or 0)
        key = ("framed", world_size, init_sync, len(ranks))
        framed = memo.get(key)
        if not isinstance(framed, list):
            shares = [_shared(views, g, init_sync) for g in range(world_size)]
            framed = memo[key] = [_VIEWS + _varint(len(s) + len(ranks)) + s for s in shares]
        return b"".join((header, ranks.join(framed), ranks))
    parts = [header]
    for g in range(world_size):
        if views.steady_for(replica_id, g, init_sync):
            rank, max_rank = views.ranks(replica_id, g, init_sync)
            view = _shared(views, g, init_sync) + _RANK + _varint(rank)
            view += _MAX_RANK + _varint(max_rank or 0)
        else:
            result = views.result(replica_id, g, init_sync)
            view = result_to_proto(result, divergence=True).SerializeToString()
        parts.append(_VIEWS + _varint(len(view)) + view)
    return b"".join(parts)


def _shared(views: QuorumViews, group_rank: int, init_sync: bool) -> bytes:
    """Group rank `group_rank`'s steady share, serialized once per quorum."""
    shared = views.memo.get((group_rank, init_sync))
    if not isinstance(shared, bytes):
        share = views.steady_share(group_rank, init_sync)
        shared = result_to_proto(share, divergence=True).SerializeToString()
        views.memo[(group_rank, init_sync)] = shared
    return shared


_VIEWS = b"\xa2\x06"  # LighthouseQuorumResponse.views: field 100, length-delimited
_RANK = b"\x48"  # ManagerQuorumResponse.replica_rank: field 9, varint
_MAX_RANK = b"\x38"  # ManagerQuorumResponse.max_replica_rank: field 7, varint


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
