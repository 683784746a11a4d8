"""A group's view of a quorum (lighthouse.core.views, lighthouse.wire): what the
lighthouse answers a group that asks for its share instead of every member."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lighthouse import wire
from lighthouse.core.member_data import fingerprint_entry
from lighthouse.core.quorum import Quorum, QuorumMember
from lighthouse.core.views import MAX_SOURCES, MAX_VIEW_RANKS, QuorumViews, compute_quorum_result
from lighthouse.rpc.proto import torchft_pb2 as pb


def member(i: int, step: int, world_size: int = 8, data: str = "") -> QuorumMember:
    rid = f"group{i:05d}:0123456789abcdef"
    return QuorumMember(
        replica_id=rid,
        address=f"http://host{i}.cluster.example:29512",
        store_address=f"host{i}.cluster.example:29500",
        step=step,
        world_size=world_size,
        data=data,
    )


def job(n: int, behind: int = 0, step: int = 1000) -> Quorum:
    return Quorum(
        quorum_id=1_764_000_000_000,
        participants=tuple(member(i, step if i >= behind else 3) for i in range(n)),
        created=1_764_000_000.25,
    )


def view_of(quorum: Quorum, rid: str, world_size: int, init_sync: bool = False) -> bytes:
    return wire.view_response(QuorumViews(quorum), rid, world_size, init_sync)


@pytest.mark.parametrize(
    ("n", "behind", "init_sync", "step"),
    [
        (1, 0, False, 5),
        (3, 0, False, 5),  # steady
        (5, 2, False, 5),  # two heal
        (4, 0, True, 0),  # a fresh job: one keeps its weights
        (70, 3, False, 9),  # more up to date than MAX_SOURCES
        (200, 0, False, 9),  # steady, ranks past 127 (two-byte varints)
        (200, 1, False, 9),  # one heals: its sources steady nowhere but elsewhere
    ],
)
def test_each_ranks_view_is_what_the_member_list_gives(n, behind, init_sync, step):
    """One rule, two paths: the view the lighthouse answers decodes to the
    result a ManagerServer computes from every member."""
    quorum = job(n, behind, step)
    for m in quorum.participants:
        response = pb.LighthouseQuorumResponse.FromString(
            view_of(quorum, m.replica_id, 3, init_sync)
        )
        assert not response.quorum.participants
        assert response.quorum.quorum_id == quorum.quorum_id
        assert wire.quorum_from_proto(response.quorum).created == pytest.approx(quorum.created)
        got = [wire.result_from_proto(v) for v in response.views]
        want = [compute_quorum_result(quorum, m.replica_id, g, init_sync) for g in range(3)]
        assert got == want
        assert all(len(r.recover_src_replica_ranks) <= MAX_SOURCES for r in got)


def test_a_divergence_travels_in_the_view_for_the_group_to_log():
    data = {
        i: json.dumps(fingerprint_entry(5, {0: value}, 1))
        for i, value in enumerate(["aa", "aa", "bb"])
    }
    quorum = Quorum(
        quorum_id=3,
        participants=tuple(member(i, 5, 1, data=data[i]) for i in range(3)),
        created=0.0,
    )
    odd = quorum.participants[2].replica_id
    views = pb.LighthouseQuorumResponse.FromString(view_of(quorum, odd, 1)).views
    result = wire.result_from_proto(views[0])
    assert result.heal and "keeping aa" in result.divergence
    assert result == compute_quorum_result(quorum, odd, 0, False)


@pytest.mark.parametrize("n", [1_000, 10_000])
def test_an_answer_is_constant_in_the_jobs_size(n):
    """The member list is ~90 bytes a member; a steady view of 8 group ranks
    stays under 1 KB however many groups the job has."""
    quorum = job(n)
    rid = quorum.participants[n // 2].replica_id
    full = pb.LighthouseQuorumResponse(quorum=wire.quorum_to_proto(quorum)).ByteSize()
    view = len(view_of(quorum, rid, 8))
    assert view < 1024
    assert full > 80 * n


def test_views_are_computed_once_per_group_rank_not_once_per_member():
    quorum = job(2_000, behind=10)
    views = QuorumViews(quorum)
    for m in quorum.participants:
        views.result(m.replica_id, 0, False)
    assert len(views._plans) == 1  # noqa: SLF001 (the cache is what is tested)


@pytest.mark.parametrize("world_size", [0, MAX_VIEW_RANKS + 1])
def test_a_view_for_an_impossible_group_is_refused(world_size):
    request = pb.LighthouseQuorumRequest(
        requester=wire.member_to_proto(dataclasses.replace(member(0, 1), world_size=world_size))
    )
    request.view.init_sync = False
    with pytest.raises(ValueError, match="world_size in"):
        wire.viewer_from_proto(request, wire.quorum_request_from_proto(request))


def test_a_request_without_a_view_wants_every_member():
    request = pb.LighthouseQuorumRequest(requester=wire.member_to_proto(member(0, 1)))
    assert wire.viewer_from_proto(request, wire.quorum_request_from_proto(request)) is None


def test_a_non_member_is_refused_naming_it():
    with pytest.raises(ValueError, match="is not in quorum"):
        QuorumViews(job(3)).result("stranger", 0, False)
