"""lighthouse.wire: fields our proto does not declare survive a round trip."""

from __future__ import annotations

from lighthouse import wire
from lighthouse.core.quorum import Quorum, QuorumMember
from lighthouse.rpc.proto import torchft_pb2 as pb


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited field (wire type 2), short enough for 1-byte varints."""
    assert number < 16 and len(payload) < 128
    return bytes([(number << 3) | 2, len(payload)]) + payload


KNOWN = pb.QuorumMember(
    replica_id="group0:1234",
    address="http://127.0.0.1:1",
    store_address="127.0.0.1:2",
    step=7,
    world_size=2,
    data='{"k": 1}',
    commit_failures=1,
).SerializeToString()
# A newer torchft's member: two values of a repeated string field 9 and a
# varint field 15 (tag 15 << 3 | 0 = 0x78), none of which our proto knows.
EXTRA = _field(9, b"handle-a") + _field(9, b"handle-b") + bytes([0x78, 0x2A])


def test_a_member_with_unknown_fields_round_trips_byte_exact():
    member = wire.member_from_proto(pb.QuorumMember.FromString(KNOWN + EXTRA))
    assert member.unknown_fields == EXTRA
    assert member.step == 7 and member.replica_id == "group0:1234"
    assert wire.member_to_proto(member).SerializeToString() == KNOWN + EXTRA


def test_a_member_without_unknown_fields_serializes_as_before():
    member = wire.member_from_proto(pb.QuorumMember.FromString(KNOWN))
    assert member.unknown_fields == b""
    assert wire.member_to_proto(member).SerializeToString() == KNOWN


def test_unknown_fields_of_every_participant_reach_the_quorum_response():
    other = pb.QuorumMember(replica_id="group1:5678", step=7).SerializeToString()
    quorum = Quorum(
        quorum_id=3,
        participants=(
            wire.member_from_proto(pb.QuorumMember.FromString(KNOWN + EXTRA)),
            wire.member_from_proto(pb.QuorumMember.FromString(other + _field(9, b"h1"))),
        ),
        created=1.5,
    )
    sent = pb.LighthouseQuorumResponse(quorum=wire.quorum_to_proto(quorum)).SerializeToString()
    received = pb.LighthouseQuorumResponse.FromString(sent).quorum
    assert [m.SerializeToString() for m in received.participants] == [
        KNOWN + EXTRA,
        other + _field(9, b"h1"),
    ]
    assert wire.quorum_from_proto(received) == quorum


def test_a_member_built_in_python_has_no_unknown_fields():
    member = QuorumMember(replica_id="r:1", step=2, world_size=3)
    msg = wire.member_to_proto(member)
    assert (
        msg.SerializeToString()
        == pb.QuorumMember(replica_id="r:1", step=2, world_size=3).SerializeToString()
    )
