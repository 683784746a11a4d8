"""Conversion between protobuf messages and the plain dataclasses of the logic.

Pure code never sees a protobuf object; servicers and clients convert here,
and bad input is turned into a ValueError naming the field.
"""

from __future__ import annotations

import json

from google.protobuf.timestamp_pb2 import Timestamp
from google.protobuf.unknown_fields import UnknownFieldSet

from lighthouse.quorum import Quorum, QuorumMember
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
