"""lighthouse.core.member_data: the keys of QuorumMember.data, written byte for byte
as before and read leniently (a peer may put anything there)."""

from __future__ import annotations

import json

import pytest

from lighthouse.core.member_data import (
    FINGERPRINT_KEY,
    HEAL_KEY,
    LOCAL_RENDEZVOUS,
    RENDEZVOUS_KEY,
    HealReport,
    batch_slot_of,
    fingerprint_entry,
    fingerprint_of,
    group_data,
    heal_report_of,
    is_local_rendezvous,
    merge_rank_heal_reports,
    rank_heal_report,
)

HEAL_A = '{"step": 9, "seconds": 0.75, "bytes": 100, "source": "http://src:1"}'
HEAL_B = '{"step": 9, "seconds": 0.5, "bytes": 60, "source": "http://src:1"}'


def test_the_keys_are_the_ones_on_the_wire():
    assert (FINGERPRINT_KEY, HEAL_KEY, RENDEZVOUS_KEY, LOCAL_RENDEZVOUS) == (
        "fingerprint",
        "heal",
        "rendezvous",
        "local",
    )


# Golden texts: what torchft_like groups have sent since the keys were added
# (json.dumps of the dict in this key order); a change here breaks mixed jobs.
@pytest.mark.parametrize(
    "fingerprints, heal_reports, local, expected",
    [
        ({}, (), False, ""),
        ({0: "", 1: ""}, ("", "not json"), False, ""),
        ({0: "a", 1: ""}, (), False, '{"fingerprint": {"step": 4, "values": ["a", ""]}}'),
        (
            {},
            (HEAL_A, HEAL_B),
            False,
            '{"heal": {"step": 9, "seconds": 0.75, "bytes": 160, "sources": ["http://src:1"]}}',
        ),
        ({}, (), True, '{"rendezvous": "local"}'),
        (
            {1: "b"},
            (HEAL_A,),
            True,
            '{"fingerprint": {"step": 4, "values": ["", "b"]}, '
            '"heal": {"step": 9, "seconds": 0.75, "bytes": 100, "sources": ["http://src:1"]}, '
            '"rendezvous": "local"}',
        ),
    ],
)
def test_a_groups_data_is_the_json_of_its_entries_in_key_order_or_empty(
    fingerprints, heal_reports, local, expected
):
    data = group_data(
        step=4,
        fingerprints=fingerprints,
        world_size=2,
        heal_reports=heal_reports,
        local_rendezvous=local,
    )
    assert data == expected


def test_fingerprint_entry_lists_one_value_per_group_rank():
    assert fingerprint_entry(7, {1: "q", 0: "p"}, 3) == {
        "fingerprint": {"step": 7, "values": ["p", "q", ""]}
    }


def test_fingerprint_entry_is_empty_when_no_rank_sent_one():
    assert fingerprint_entry(7, {0: "", 1: ""}, 2) == {}


def test_a_ranks_heal_report_is_the_json_it_has_always_sent():
    text = rank_heal_report(5, 0.123456, 4096, "http://a:1")
    assert text == '{"step": 5, "seconds": 0.1235, "bytes": 4096, "source": "http://a:1"}'


@pytest.mark.parametrize(
    "reports, expected",
    [
        ([], None),
        (["", "not json", '{"step": 1}', "[1]", '"text"'], None),
        (
            [
                '{"step": 4, "seconds": 0.5, "bytes": 100, "source": "http://a:1"}',
                '{"step": 4, "seconds": 0.7, "bytes": 50, "source": "http://b:1"}',
                '{"step": 3, "seconds": 9.0, "bytes": 1, "source": "http://c:1"}',
            ],
            {"step": 4, "seconds": 0.7, "bytes": 150, "sources": ["http://a:1", "http://b:1"]},
        ),
        (
            ['{"step": 2, "seconds": 1, "bytes": 3}'],
            {"step": 2, "seconds": 1.0, "bytes": 3, "sources": []},
        ),
    ],
)
def test_a_groups_ranks_heal_reports_merge_into_one(reports, expected):
    assert merge_rank_heal_reports(reports) == expected


@pytest.mark.parametrize(
    "data, step, group_rank, expected",
    [
        ('{"fingerprint": {"step": 5, "values": ["x", "y"]}}', 5, 1, "y"),
        ({"fingerprint": {"step": 5, "values": ["x", "y"]}}, 5, 0, "x"),
        ('{"fingerprint": {"step": 5, "values": ["x"]}}', 5, 3, None),
        ('{"fingerprint": {"step": 4, "values": ["x"]}}', 5, 0, None),
        ('{"fingerprint": {"step": 5, "values": [""]}}', 5, 0, None),
        ('{"fingerprint": {"step": 5, "values": [3]}}', 5, 0, None),
        ('{"fingerprint": "x"}', 5, 0, None),
        ("[1, 2]", 5, 0, None),
        ("not json", 5, 0, None),
        ("", 5, 0, None),
        (None, 5, 0, None),
    ],
)
def test_a_fingerprint_is_read_only_from_a_well_formed_entry_of_the_same_step(
    data, step, group_rank, expected
):
    assert fingerprint_of(data, step, group_rank) == expected


@pytest.mark.parametrize(
    "data, expected",
    [
        ("", None),
        (None, None),
        ("not json", None),
        ('{"fingerprint": {}}', None),
        ("[1, 2]", None),
        ('{"heal": {"step": 2}}', None),
        ('{"heal": [1]}', None),
        ({"heal": {"step": 2, "seconds": 1, "bytes": 3}}, HealReport(2, 1.0, 3)),
        (
            json.dumps({"heal": {"step": 2, "seconds": 1.5, "bytes": 3, "sources": ["x"]}}),
            HealReport(2, 1.5, 3, ("x",)),
        ),
    ],
)
def test_a_heal_report_is_read_from_member_data_or_ignored(data, expected):
    assert heal_report_of(data) == expected


@pytest.mark.parametrize(
    "data, expected",
    [
        ('{"rendezvous": "local"}', True),
        ({"rendezvous": "local"}, True),
        ('{"fingerprint": "x", "rendezvous": "local"}', True),
        ('{"rendezvous": "other"}', False),
        ('{"rendezvous": ', False),
        ('["rendezvous", "local"]', False),
        ('{"fingerprint": "x"}', False),
        ("", False),
        (None, False),
        ({}, False),
    ],
)
def test_a_group_is_local_only_when_its_data_says_so(data, expected):
    assert is_local_rendezvous(data) is expected


@pytest.mark.parametrize("data", ["", "user text", '{"lr": 0.1, "note": "torchft"}', {"k": [1]}])
def test_a_pytorch_torchft_peers_data_reads_as_none_of_ours(data):
    assert fingerprint_of(data, 0, 0) is None
    assert heal_report_of(data) is None
    assert not is_local_rendezvous(data)


def test_what_a_group_writes_its_readers_read_back():
    data = group_data(
        step=6,
        fingerprints={0: "f0", 1: "f1"},
        world_size=2,
        heal_reports=[rank_heal_report(6, 0.25, 10, "http://s:1")],
        local_rendezvous=True,
    )
    assert fingerprint_of(data, 6, 1) == "f1"
    assert heal_report_of(data) == HealReport(6, 0.25, 10, ("http://s:1",))
    assert is_local_rendezvous(data)


@pytest.mark.parametrize(
    "data, expected",
    [
        ('{"slot": 2}', 2),
        ('{"fingerprint": {"step": 1, "values": ["a"]}, "slot": 0}', 0),
        ({"slot": -1}, -1),
        ("", None),
        (None, None),
        ('{"slot": "2"}', None),
        ('{"slot": true}', None),
        ("slot but not json", None),
        ('["slot"]', None),
    ],
)
def test_a_batch_slot_is_read_only_as_an_integer(data, expected):
    assert batch_slot_of(data) == expected


def test_the_batch_slot_comes_last_in_a_groups_data():
    data = group_data(step=1, fingerprints={0: "a"}, world_size=1, batch_slot=3)
    assert data == '{"fingerprint": {"step": 1, "values": ["a"]}, "slot": 3}'
