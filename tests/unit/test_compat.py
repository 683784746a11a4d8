"""lighthouse.core.compat: which members of a mixed-version job may share an allreduce."""

from __future__ import annotations

import pytest

from lighthouse.core.compat import (
    HANDLES,
    LOCAL,
    STORE,
    field_numbers,
    refusals,
    rendezvous_of,
    training_members,
)
from lighthouse.core.quorum import (
    LighthouseConfig,
    LighthouseState,
    Participant,
    QuorumMember,
    compute_quorum,
)

HANDLE = b'{"id": "ab", "store": "h:1", "global_rank": 0}'
# What torchft 2026.10.26's ManagerServer sends for a group of two ranks:
# field 9 (reconfigure_handles), length-delimited, once per group rank.
TWO_HANDLES = bytes([0x4A, len(HANDLE)]) + HANDLE + bytes([0x4A, len(HANDLE)]) + HANDLE


def member(rid: str, kind: str = STORE) -> QuorumMember:
    if kind == HANDLES:
        return QuorumMember(replica_id=rid, unknown_fields=TWO_HANDLES)
    if kind == LOCAL:
        return QuorumMember(replica_id=rid, data='{"rendezvous": "local"}')
    return QuorumMember(replica_id=rid, data='{"fingerprint": "x"}')


@pytest.mark.parametrize(
    "raw, numbers",
    [
        (b"", set()),
        (TWO_HANDLES, {9}),
        (bytes([0x78, 0x2A]), {15}),  # a varint field 15
        (bytes([0x4A, 0x01, 0x41, 0x79, 1, 2, 3, 4, 5, 6, 7, 8]), {9, 15}),  # + a fixed64
        (bytes([0x4A, 0x7F, 0x41]), set()),  # a length past the end: nothing trusted
        (bytes([0x78, 0x2A, 0xFF]), {15}),  # a garbled tail keeps what came before
    ],
    ids=["empty", "handles", "varint", "two kinds", "cut short", "garbled tail"],
)
def test_field_numbers_reads_tags_and_stops_at_malformed_bytes(raw, numbers):
    assert field_numbers(raw) == numbers


@pytest.mark.parametrize(
    "m, kind",
    [
        (QuorumMember(replica_id="a"), STORE),
        (member("a", HANDLES), HANDLES),
        (QuorumMember(replica_id="a", unknown_fields=bytes([0x78, 0x2A])), STORE),
        (member("a", LOCAL), LOCAL),
        (QuorumMember(replica_id="a", data={"rendezvous": "local"}), LOCAL),
        (QuorumMember(replica_id="a", data="rendezvous, not JSON"), STORE),
        (QuorumMember(replica_id="a", data='{"rendezvous": "other"}'), STORE),
    ],
    ids=["plain", "reconfigure handles", "another unknown field", "local", "local dict",
         "not JSON", "unknown value"],
)  # fmt: skip
def test_a_members_rendezvous_is_read_from_field_9_and_its_data(m, kind):
    assert rendezvous_of(m) == kind


@pytest.mark.parametrize(
    "kinds, prev, refused",
    [
        ({"s1": STORE, "s2": STORE}, [], set()),
        ({"h1": HANDLES, "h2": HANDLES}, [], set()),
        ({"h1": HANDLES, "s1": STORE}, [], {"h1"}),
        ({"h1": HANDLES, "h2": HANDLES, "s1": STORE}, [], {"s1"}),
        ({"h1": HANDLES, "s1": STORE, "s2": STORE}, ["h1"], {"s1", "s2"}),
        ({"h1": HANDLES, "h2": HANDLES, "s1": STORE}, ["s1"], {"h1", "h2"}),
        ({"h1": HANDLES, "s1": STORE, "s2": STORE}, ["h1", "s1"], {"h1"}),
        ({"h1": HANDLES, "l1": LOCAL}, [], set()),
        ({"s1": STORE, "l1": LOCAL}, [], set()),
        ({"h1": HANDLES, "s1": STORE, "l1": LOCAL, "l2": LOCAL}, ["l1", "l2"], {"h1"}),
    ],
    ids=["all store", "all handles", "a tie keeps store", "the majority is kept",
         "the previous quorum's side is kept", "even when fewer",
         "a mixed previous quorum: the majority", "local beside handles",
         "local beside store", "local members do not count"],
)  # fmt: skip
def test_the_side_not_kept_is_refused(kinds, prev, refused):
    members = {rid: member(rid, kind) for rid, kind in kinds.items()}
    assert set(refusals(members, prev)) == refused


def test_the_refusal_names_both_versions_the_kept_groups_and_what_to_do():
    members = {"h1": member("h1", HANDLES), "s1": member("s1"), "s2": member("s2")}
    why = refusals(members, [])["h1"]
    assert why.startswith(
        "replica h1 speaks torchft's reconfigure-handle rendezvous (pytorch/torchft nightly "
        ">= 2026.10) but this job's members (2: s1, s2) use store rendezvous (torchft_like "
        "0.1.0, pytorch/torchft <= 0.2.0)"
    )
    assert "Run every replica group of a job on one of the two" in why
    back = refusals({"h1": member("h1", HANDLES), "s1": member("s1")}, ["h1"])["s1"]
    assert "replica s1 speaks store rendezvous" in back
    assert "use torchft's reconfigure-handle rendezvous" in back


NOW = 100.0
CONFIG = LighthouseConfig(min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=1000)


def test_a_refused_replica_is_answered_and_holds_up_neither_majority_nor_join_timeout():
    waiting = {
        rid: Participant(member(rid, kind), NOW) for rid, kind in [("h1", HANDLES), ("s1", STORE)]
    }
    st = LighthouseState(waiting, {"h1": NOW, "s1": NOW})
    decision = compute_quorum(NOW, st, CONFIG)
    assert decision.kind == "valid"
    assert [m.replica_id for m in decision.members or ()] == ["s1"]
    assert set(decision.refused) == {"h1"}
    assert "[1 refused, another rendezvous: h1]" in decision.reason


def test_a_live_replica_of_the_other_side_not_waiting_now_is_not_a_straggler():
    st = LighthouseState(
        {"s1": Participant(member("s1"), NOW)},
        {"h1": NOW, "s1": NOW},
        described={"h1": member("h1", HANDLES)},
    )
    decision = compute_quorum(NOW, st, CONFIG)
    assert decision.kind == "valid"  # not "stragglers": h1 cannot join this job
    assert [m.replica_id for m in decision.members or ()] == ["s1"]
    assert set(decision.refused) == {"h1"}  # not waiting: nothing to answer


def test_without_mixed_members_nothing_is_refused():
    st = LighthouseState({"s1": Participant(member("s1"), NOW)}, {"s1": NOW})
    assert compute_quorum(NOW, st, CONFIG).refused == {}


def test_the_training_side_is_the_members_at_the_furthest_step_past_zero():
    def at(rid: str, step: int) -> QuorumMember:
        return QuorumMember(replica_id=rid, step=step)

    assert training_members([at("h1", 7), at("s1", 0), at("h2", 7)]) == ("h1", "h2")
    assert training_members([at("h1", 0), at("s1", 0)]) == ()
    assert training_members([]) == ()
