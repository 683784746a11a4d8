"""The group-merge rule: a replica group's per-rank requests -> its one lighthouse request."""

import json

import pytest

from lighthouse.core.member_data import FINGERPRINT_KEY, heal_report_of
from torchft_like.manager.group.group_request import QuorumRequest, merge_requests


def merge(*requests: QuorumRequest, world_size: int | None = None):
    return merge_requests(
        {r.group_rank: r for r in requests},
        replica_id="g:1",
        address="http://h:1",
        store_address="h:2",
        world_size=world_size or len(requests),
    )


@pytest.mark.parametrize(
    "requests, step, shrink_only, init_sync, commit_failures",
    [
        ([QuorumRequest(0, 5)], 5, False, True, 0),
        ([QuorumRequest(0, 5), QuorumRequest(1, 7)], 7, False, True, 0),
        ([QuorumRequest(0, 5, shrink_only=True), QuorumRequest(1, 5)], 5, True, True, 0),
        (
            [QuorumRequest(0, 5, init_sync=False), QuorumRequest(1, 5, init_sync=False)],
            5, False, False, 0,
        ),
        ([QuorumRequest(0, 5, init_sync=False), QuorumRequest(1, 5)], 5, False, True, 0),
        (
            [QuorumRequest(0, 5, commit_failures=2), QuorumRequest(1, 5, commit_failures=0)],
            5, False, True, 2,
        ),
    ],
    ids=["one rank", "furthest step", "any shrink_only", "no init_sync", "any init_sync",
         "worst commit_failures"],
)  # fmt: skip
def test_the_group_asks_as_its_ranks_together(
    requests, step, shrink_only, init_sync, commit_failures
):
    group = merge(*requests)
    assert group.member.step == step
    assert group.member.shrink_only == shrink_only
    assert group.init_sync == init_sync
    assert group.member.commit_failures == commit_failures


def test_the_member_describes_the_group_where_peers_reach_it():
    member = merge(QuorumRequest(0, 1), QuorumRequest(1, 1)).member
    assert (member.replica_id, member.address, member.store_address) == ("g:1", "http://h:1", "h:2")
    assert member.world_size == 2


@pytest.mark.parametrize(
    "requests, values",
    [
        ([QuorumRequest(0, 4), QuorumRequest(1, 4)], None),
        ([QuorumRequest(0, 4, fingerprint="a"), QuorumRequest(1, 4, fingerprint="b")], ["a", "b"]),
        ([QuorumRequest(0, 4, fingerprint="a"), QuorumRequest(1, 4)], ["a", ""]),
        # A rank behind the group's step compares with nobody: its value stays out.
        ([QuorumRequest(0, 3, fingerprint="old"), QuorumRequest(1, 4, fingerprint="b")],
         ["", "b"]),
    ],
    ids=["none sent", "every rank", "one rank", "rank behind"],
)  # fmt: skip
def test_fingerprints_travel_only_from_ranks_at_the_group_step(requests, values):
    data = merge(*requests).member.data
    if values is None:
        assert data == ""
    else:
        assert json.loads(data)[FINGERPRINT_KEY] == {"step": 4, "values": values}


def test_the_ranks_heal_reports_travel_merged_beside_the_fingerprints():
    report = '{{"step": 9, "seconds": {s}, "bytes": {b}, "source": "http://src:1"}}'
    member = merge(
        QuorumRequest(0, 10, fingerprint="a", heal_report=report.format(s=0.5, b=100)),
        QuorumRequest(1, 10, heal_report=report.format(s=0.75, b=60)),
    ).member
    data = json.loads(member.data)
    assert data["heal"] == {"step": 9, "seconds": 0.75, "bytes": 160, "sources": ["http://src:1"]}
    assert data[FINGERPRINT_KEY]["values"] == ["a", ""]
    assert heal_report_of(member.data) is not None


def test_an_empty_group_request_is_refused():
    with pytest.raises(ValueError, match="at least one rank"):
        merge_requests({}, "g:1", "", "", 1)


@pytest.mark.parametrize(
    "request_, word",
    [
        (QuorumRequest(2, 0), r"group_rank \(2\) must be in \[0, 2\)"),
        (QuorumRequest(-1, 0), r"group_rank \(-1\)"),
        (QuorumRequest(0, -3), r"step \(-3\) must not be negative"),
        (QuorumRequest(0, 0, commit_failures=-1), r"commit_failures \(-1\)"),
    ],
)
def test_a_request_out_of_range_names_the_field(request_, word):
    with pytest.raises(ValueError, match=word):
        request_.check(world_size=2)


def test_a_rank_request_crosses_the_wire_with_every_field():
    from dataclasses import fields

    from torchft_like.manager.group import wire

    request = QuorumRequest(
        group_rank=1, step=7, checkpoint_metadata="http://h:3", shrink_only=True,
        init_sync=False, commit_failures=2, fingerprint="f", heal_report='{"step": 6}',
        batch_slot=3,
    )  # fmt: skip
    # Every field set apart from its default, so a field wire.py forgets fails here.
    assert all(getattr(request, f.name) != f.default for f in fields(QuorumRequest))
    assert wire.quorum_request_from_proto(wire.quorum_request_to_proto(request)) == request


def test_a_group_whose_collectives_stay_local_says_so_for_lighthouse_compat():
    from lighthouse.core.compat import LOCAL, STORE, rendezvous_of

    local = merge_requests({0: QuorumRequest(0, 3)}, "g:1", "", "", 1, local_collectives=True)
    assert rendezvous_of(local.member) == LOCAL
    assert rendezvous_of(merge(QuorumRequest(0, 3)).member) == STORE


@pytest.mark.parametrize(
    "slots, expected",
    [
        ((None, None), None),  # no rank takes its batch by the quorum
        ((2, 2), 2),
        ((-1, -1), -1),
        ((1, 2), -1),  # the ranks took different units: they cannot all be the quorum's
        ((1, None), -1),
    ],
)
def test_the_group_claims_its_ranks_common_batch_slot(slots, expected):
    from lighthouse.core.member_data import batch_slot_of

    group = merge(*(QuorumRequest(r, 5, batch_slot=s) for r, s in enumerate(slots)))
    assert batch_slot_of(group.member.data) == expected
