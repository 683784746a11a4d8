"""Table-driven tests of the per-rank quorum result (who heals from whom)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lighthouse.core.member_data import fingerprint_entry
from lighthouse.core.quorum import Quorum, QuorumMember
from lighthouse.core.views import compute_quorum_result, member_fingerprint
from torchft_like.data.claims import BatchSlot, slot_forecast
from torchft_like.manager.heal_plan import (
    HEAL_SOURCES_ENV,
    heal_sources,
    heal_sources_from_env,
    transfer_plan,
)


def quorum(steps: dict[str, int], failures: int = 0) -> Quorum:
    return Quorum(
        quorum_id=9,
        participants=tuple(
            QuorumMember(
                replica_id=rid,
                address=f"http://{rid}:1",
                store_address=f"{rid}:2",
                step=step,
                commit_failures=failures,
            )
            for rid, step in steps.items()
        ),
        created=0.0,
    )


# Columns: replica_rank, world, max_step, max_replica_rank, max_world, heal,
# src replica rank, src address, dst ranks, store of the primary.
CASES = [
    (
        "healthy steady state",
        {"a": 5, "b": 5},
        "a",
        0,
        False,
        (0, 2, 5, 0, 2, False, None, "", (), "a:2"),
    ),
    (
        "rank 1 of the group uses the next primary",
        {"a": 5, "b": 5},
        "a",
        1,
        False,
        (0, 2, 5, 0, 2, False, None, "", (), "b:2"),
    ),
    (
        "one replica behind heals",
        {"a": 5, "b": 2},
        "b",
        0,
        True,
        (1, 2, 5, None, 1, True, 0, "http://a:1", (), "a:2"),
    ),
    (
        "the up-to-date replica is the source",
        {"a": 5, "b": 2},
        "a",
        0,
        True,
        (0, 2, 5, 0, 1, False, None, "", (1,), "a:2"),
    ),
    (
        "init_sync at step 0 heals all but the primary",
        {"a": 0, "b": 0, "c": 0},
        "c",
        0,
        True,
        (2, 3, 0, 2, 3, True, 0, "http://a:1", (), "a:2"),
    ),
    (
        "init_sync at step 0: the primary sends to all",
        {"a": 0, "b": 0, "c": 0},
        "a",
        0,
        True,
        (0, 3, 0, 0, 3, False, None, "", (1, 2), "a:2"),
    ),
    (
        # Every rank of one group serves (or heals) together: a state_dict
        # with collectives over the group (torchtitan's) needs them all.
        "init_sync at step 0, group rank 1: the same group keeps its weights",
        {"a": 0, "b": 0, "c": 0},
        "a",
        1,
        True,
        (0, 3, 0, 0, 3, False, None, "", (1, 2), "b:2"),
    ),
    (
        "init_sync at step 0, group rank 1: the other groups heal from it",
        {"a": 0, "b": 0, "c": 0},
        "b",
        1,
        True,
        (1, 3, 0, 1, 3, True, 0, "http://a:1", (), "b:2"),
    ),
    (
        "no init_sync at step 0: nobody heals",
        {"a": 0, "b": 0},
        "b",
        0,
        False,
        (1, 2, 0, 1, 2, False, None, "", (), "a:2"),
    ),
    (
        "several recovering replicas spread over several sources",
        {"a": 7, "b": 7, "c": 1, "d": 3},
        "d",
        0,
        False,
        (3, 4, 7, None, 2, True, 1, "http://b:1", (), "a:2"),
    ),
    (
        "the first recovering replica takes the first source",
        {"a": 7, "b": 7, "c": 1, "d": 3},
        "a",
        0,
        False,
        (0, 4, 7, 0, 2, False, None, "", (2,), "a:2"),
    ),
    (
        "another group rank shifts the sources",
        {"a": 7, "b": 7, "c": 1, "d": 3},
        "a",
        1,
        False,
        (0, 4, 7, 0, 2, False, None, "", (3,), "b:2"),
    ),
]


@pytest.mark.parametrize("name, steps, me, group_rank, init_sync, expected", CASES)
def test_quorum_result(name, steps, me, group_rank, init_sync, expected):
    r = compute_quorum_result(quorum(steps), me, group_rank, init_sync)
    got = (
        r.replica_rank,
        r.replica_world_size,
        r.max_step,
        r.max_replica_rank,
        r.max_world_size,
        r.heal,
        r.recover_src_replica_rank,
        r.recover_src_manager_address,
        r.recover_dst_replica_ranks,
        r.store_address,
    )
    assert got == expected


# Striped healing: every healing rank gets all up-to-date replicas as sources,
# its primary (the one above) first, so that several ranks healing at once
# start on different peers; every up-to-date replica serves every healer.
# Columns: src replica ranks, src addresses, stripe dst ranks.
STRIPE_CASES = [
    ("one source: a list of one", {"a": 5, "b": 2}, "b", 0, False,
     ((0,), ("http://a:1",), ())),
    ("the one source serves the one healer", {"a": 5, "b": 2}, "a", 0, False,
     ((), (), (1,))),
    ("three up to date: all three, primary first", {"a": 7, "b": 7, "c": 7, "d": 1}, "d", 0,
     False, ((0, 1, 2), ("http://a:1", "http://b:1", "http://c:1"), ())),
    ("group rank 1 starts on the next peer", {"a": 7, "b": 7, "c": 7, "d": 1}, "d", 1, False,
     ((1, 2, 0), ("http://b:1", "http://c:1", "http://a:1"), ())),
    ("two healing at once start on different peers (first)",
     {"a": 7, "b": 7, "c": 7, "d": 1, "e": 2}, "d", 0, False,
     ((0, 1, 2), ("http://a:1", "http://b:1", "http://c:1"), ())),
    ("two healing at once start on different peers (second)",
     {"a": 7, "b": 7, "c": 7, "d": 1, "e": 2}, "e", 0, False,
     ((1, 2, 0), ("http://b:1", "http://c:1", "http://a:1"), ())),
    ("an up-to-date replica serves stripes to every healer",
     {"a": 7, "b": 7, "c": 7, "d": 1, "e": 2}, "c", 0, False,
     ((), (), (3, 4))),
    ("init_sync at step 0: the primary is the only source", {"a": 0, "b": 0, "c": 0}, "c", 0,
     True, ((0,), ("http://a:1",), ())),
    ("nobody heals: no sources, nothing to serve", {"a": 5, "b": 5}, "b", 0, False,
     ((), (), ())),
]  # fmt: skip


@pytest.mark.parametrize("name, steps, me, group_rank, init_sync, expected", STRIPE_CASES)
def test_striped_sources(name, steps, me, group_rank, init_sync, expected):
    r = compute_quorum_result(quorum(steps), me, group_rank, init_sync)
    got = (r.recover_src_replica_ranks, r.recover_src_manager_addresses,
           r.recover_stripe_dst_replica_ranks)  # fmt: skip
    assert got == expected
    if r.heal:  # the primary of the single-source fields comes first
        assert r.recover_src_replica_ranks[0] == r.recover_src_replica_rank
        assert r.recover_src_manager_addresses[0] == r.recover_src_manager_address
    assert set(r.recover_dst_replica_ranks) <= set(r.recover_stripe_dst_replica_ranks)


def test_every_healer_takes_a_stripe_from_every_source_and_each_source_serves_all():
    steps = {"a": 9, "b": 9, "c": 9, "d": 4, "e": 4, "f": 0}
    results = {rid: compute_quorum_result(quorum(steps), rid, 0, False) for rid in steps}
    ids = sorted(steps)
    primaries = [results[h].recover_src_replica_rank for h in ("d", "e", "f")]
    assert sorted(primaries) == [0, 1, 2]  # three healers, three different first peers
    for h in ("d", "e", "f"):
        assert sorted(results[h].recover_src_replica_ranks) == [0, 1, 2]
    for src in ("a", "b", "c"):
        assert results[src].recover_stripe_dst_replica_ranks == (3, 4, 5)
    assert ids == ["a", "b", "c", "d", "e", "f"]


def test_participants_are_ranked_by_replica_id_whatever_their_order():
    q = quorum({"c": 1, "a": 1, "b": 1})
    assert [compute_quorum_result(q, rid, 0, False).replica_rank for rid in "abc"] == [0, 1, 2]


def test_commit_failures_are_passed_on():
    assert compute_quorum_result(quorum({"a": 1}, failures=2), "a", 0, False).commit_failures == 2


def test_a_replica_outside_the_quorum_is_an_error():
    with pytest.raises(ValueError, match="replica z is not in quorum 9"):
        compute_quorum_result(quorum({"a": 1}), "z", 0, False)


# ---- divergence: fingerprints shared in QuorumMember.data ------------------


def fp_quorum(members: dict[str, tuple[int, object]]) -> Quorum:
    """members: replica_id -> (step, data), data a dict (JSON-encoded) or a raw string."""
    return Quorum(
        quorum_id=9,
        participants=tuple(
            QuorumMember(
                replica_id=rid,
                address=f"http://{rid}:1",
                store_address=f"{rid}:2",
                step=step,
                data=data if isinstance(data, str) else json.dumps(data),
            )
            for rid, (step, data) in members.items()
        ),
        created=0.0,
    )


def fp(step: int, *values: str) -> dict:
    return fingerprint_entry(step, dict(enumerate(values)), len(values))


# Columns: replica ids that heal because they diverged (in sorted order), and
# words the reason must contain ("" when nothing diverged).
DIVERGENCE_CASES = [
    ("all agree", {"a": (5, fp(5, "x")), "b": (5, fp(5, "x"))}, 0, (), ""),
    (
        "two replicas disagree: the tie keeps the lowest replica_id",
        {"a": (5, fp(5, "x")), "b": (5, fp(5, "y"))},
        0,
        ("b",),
        "keeping x held by a (tie, lowest replica_id); y held by b; healing b",
    ),
    (
        "the tie rule looks at replica ids, not at the order in the quorum",
        {"b": (5, fp(5, "x")), "a": (5, fp(5, "y"))},
        0,
        ("b",),
        "keeping y held by a",
    ),
    (
        "the majority wins even against the lowest replica_id",
        {"a": (5, fp(5, "y")), "b": (5, fp(5, "x")), "c": (5, fp(5, "x"))},
        0,
        ("a",),
        "keeping x held by b, c (majority); y held by a; healing a",
    ),
    (
        "three different values: the lowest replica_id's is kept",
        {"a": (5, fp(5, "x")), "b": (5, fp(5, "y")), "c": (5, fp(5, "z"))},
        0,
        ("b", "c"),
        "healing b, c",
    ),
    (
        "two against two: the pair with the lowest replica_id is kept",
        {"a": (5, fp(5, "y")), "b": (5, fp(5, "x")), "c": (5, fp(5, "x")), "d": (5, fp(5, "y"))},
        0,
        ("b", "c"),
        "keeping y held by a, d (tie",
    ),
    (
        "each group rank is compared with the same group rank only",
        {"a": (5, fp(5, "x", "p")), "b": (5, fp(5, "x", "q"))},
        1,
        ("b",),
        "for group rank 1",
    ),
    (
        "group rank 0 agrees although group rank 1 does not",
        {"a": (5, fp(5, "x", "p")), "b": (5, fp(5, "x", "q"))},
        0,
        (),
        "",
    ),
    (
        "a replica without a fingerprint is not compared",
        {"a": (5, fp(5, "x")), "b": (5, ""), "c": (5, fp(5, "x"))},
        0,
        (),
        "",
    ),
    (
        "a fingerprint of another step is not compared",
        {"a": (5, fp(5, "x")), "b": (5, fp(4, "y"))},
        0,
        (),
        "",
    ),
    (
        "a replica behind is not compared, it heals anyway",
        {"a": (5, fp(5, "x")), "b": (3, fp(3, "y"))},
        0,
        (),
        "",
    ),
    (
        "data that is not ours is ignored",
        {"a": (5, fp(5, "x")), "b": (5, "not json"), "c": (5, {"other": 1})},
        0,
        (),
        "",
    ),
    (
        "a group with fewer ranks has no fingerprint for a higher group rank",
        {"a": (5, fp(5, "x", "p")), "b": (5, fp(5, "y"))},
        1,
        (),
        "",
    ),
]


@pytest.mark.parametrize("name, members, group_rank, odd, reason", DIVERGENCE_CASES)
def test_divergence(name, members, group_rank, odd, reason):
    q = fp_quorum(members)
    ids = sorted(members)
    results = {rid: compute_quorum_result(q, rid, group_rank, False) for rid in ids}
    healing_at_max = tuple(
        rid
        for rid in ids
        if results[rid].heal and members[rid][0] == max(s for s, _ in members.values())
    )
    assert healing_at_max == odd
    for r in results.values():
        assert reason in r.divergence
        assert bool(r.divergence) == bool(odd)


def test_a_divergent_replica_heals_from_a_kept_one_and_does_not_count_as_up_to_date():
    q = fp_quorum({"a": (5, fp(5, "y")), "b": (5, fp(5, "x")), "c": (5, fp(5, "x"))})
    odd, kept = compute_quorum_result(q, "a", 0, False), compute_quorum_result(q, "b", 0, False)
    assert odd.heal and odd.recover_src_manager_address == "http://b:1"
    assert odd.recover_src_replica_rank == 1
    assert odd.max_replica_rank is None and odd.max_world_size == 2
    assert kept.recover_dst_replica_ranks == (0,)
    assert kept.max_replica_rank == 0 and kept.max_world_size == 2
    assert odd.store_address == kept.store_address == "a:2"  # the store does not move


@pytest.mark.parametrize(
    "data, group_rank, expected",
    [
        (json.dumps(fp(5, "x", "y")), 1, "y"),
        (json.dumps(fp(5, "x")), 3, None),
        (json.dumps(fp(4, "x")), 0, None),
        (json.dumps({"fingerprint": {"step": 5, "values": [3]}}), 0, None),
        (json.dumps({"fingerprint": "x"}), 0, None),
        (json.dumps([1, 2]), 0, None),
        ("", 0, None),
    ],
)
def test_member_fingerprint_reads_only_well_formed_entries_of_the_same_step(
    data, group_rank, expected
):
    member = QuorumMember(replica_id="a", step=5, data=data)
    assert member_fingerprint(member, group_rank) == expected


def test_the_striped_sources_survive_the_wire_and_an_older_server_sends_none():
    from lighthouse.rpc.proto import torchft_pb2 as pb
    from torchft_like.manager.group import wire

    steps = {"a": 7, "b": 7, "c": 7, "d": 1}
    for me in steps:
        r = compute_quorum_result(quorum(steps), me, 1, False)
        sent = wire.result_to_proto(r).SerializeToString()
        assert wire.result_from_proto(pb.ManagerQuorumResponse.FromString(sent)) == r
    healer = compute_quorum_result(quorum(steps), "d", 0, False)
    older = wire.result_to_proto(healer)  # as pytorch/torchft's server sends it: no 100-102
    for name in ("recover_src_replica_ranks", "recover_src_manager_addresses",
                 "recover_stripe_dst_replica_ranks"):  # fmt: skip
        older.ClearField(name)
    got = wire.result_from_proto(older)
    assert got.recover_src_replica_ranks == () and got.recover_src_replica_rank == 0


HEAL_SOURCE_CASES = [
    ("all by default", None, [(0, "http://a:1"), (1, "http://b:1"), (2, "http://c:1")]),
    ("a cap keeps the first", 2, [(0, "http://a:1"), (1, "http://b:1")]),
    ("1 turns striping off", 1, [(0, "http://a:1")]),
    ("a cap above the count is all", 9, [(0, "http://a:1"), (1, "http://b:1"), (2, "http://c:1")]),
]


@pytest.mark.parametrize("name, cap, expected", HEAL_SOURCE_CASES)
def test_heal_sources(name, cap, expected):
    r = compute_quorum_result(quorum({"a": 7, "b": 7, "c": 7, "d": 1}), "d", 0, False)
    assert heal_sources(r, cap) == expected


def test_heal_sources_without_the_list_is_the_primary_alone():
    r = compute_quorum_result(quorum({"a": 7, "b": 7, "d": 1}), "d", 1, False)
    older = dataclasses.replace(r, recover_src_replica_ranks=(), recover_src_manager_addresses=())
    assert heal_sources(older, None) == [(1, "http://b:1")]


def test_heal_sources_refuses_a_result_that_does_not_heal_and_a_bad_cap():
    q = quorum({"a": 7, "d": 1})
    with pytest.raises(ValueError, match="does not heal"):
        heal_sources(compute_quorum_result(q, "a", 0, False), None)
    with pytest.raises(ValueError, match="cap \\(0\\) must be at least 1"):
        heal_sources(compute_quorum_result(q, "d", 0, False), 0)


@pytest.mark.parametrize(
    "value, expected",
    [(None, None), ("", None), ("all", None), (" ALL ", None), ("1", 1), ("3", 3)],
)
def test_heal_sources_from_env(value, expected):
    environ = {} if value is None else {HEAL_SOURCES_ENV: value}
    assert heal_sources_from_env(environ) == expected


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_heal_sources_from_env_refuses_what_is_not_a_count_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"{HEAL_SOURCES_ENV}='{value}'.*'all'"):
        heal_sources_from_env({HEAL_SOURCES_ENV: value})


TRANSFER_PLAN_CASES = [
    # name, steps, me, group_rank, stripes, (sources' ranks, serve_to)
    ("a healer of 3 groups, one stripe: its primary alone", {"a": 7, "b": 7, "c": 1}, "c", 0, 1,
     ((0,), ())),
    ("the primary of that healer serves it", {"a": 7, "b": 7, "c": 1}, "a", 0, 1, ((), (2,))),
    ("the other up-to-date group serves nobody (the stall of issue 23)",
     {"a": 7, "b": 7, "c": 1}, "b", 0, 1, ((), ())),
    ("group rank 1 takes the next primary", {"a": 7, "b": 7, "c": 1}, "b", 1, 1, ((), (2,))),
    ("striped: a healer fetches from every source", {"a": 7, "b": 7, "c": 1}, "c", 0, None,
     ((0, 1), ())),
    ("striped: every source serves every healer", {"a": 7, "b": 7, "c": 1}, "b", 0, None,
     ((), (2,))),
    ("a cap of 2 of 3 sources", {"a": 7, "b": 7, "c": 7, "d": 1}, "d", 0, 2, ((0, 1), ())),
    ("one source, two healers: it serves both", {"a": 7, "b": 1, "c": 0}, "a", 0, 1,
     ((), (1, 2))),
    ("nobody heals: nothing moves", {"a": 5, "b": 5, "c": 5}, "b", 0, 1, ((), ())),
]  # fmt: skip


@pytest.mark.parametrize("name, steps, me, group_rank, stripes, expected", TRANSFER_PLAN_CASES)
def test_transfer_plan(name, steps, me, group_rank, stripes, expected):
    plan = transfer_plan(compute_quorum_result(quorum(steps), me, group_rank, False), stripes)
    assert (tuple(rank for rank, _ in plan.sources), plan.serve_to) == expected


def test_transfer_plan_refuses_a_stripe_count_below_one():
    with pytest.raises(ValueError, match="stripes \\(0\\) must be at least 1"):
        transfer_plan(compute_quorum_result(quorum({"a": 1}), "a", 0, False), 0)


def edges(steps: dict[str, int], group_rank: int, init_sync: bool, stripes: int | None):
    """(source, healer) replica-rank pairs as the healers see them and as
    the sources see them, every participant planning from its own result."""
    results = {rid: compute_quorum_result(quorum(steps), rid, group_rank, init_sync)
               for rid in steps}  # fmt: skip
    plans = {rid: transfer_plan(r, stripes) for rid, r in results.items()}
    received = {(src, results[rid].replica_rank) for rid, p in plans.items()
                for src, _ in p.sources}  # fmt: skip
    sent = {(results[rid].replica_rank, dst) for rid, p in plans.items() for dst in p.serve_to}
    return received, sent


@given(
    steps=st.lists(st.integers(0, 3), min_size=1, max_size=7),
    group_rank=st.integers(0, 3),
    init_sync=st.booleans(),
)
def test_with_one_stripe_exactly_the_ranks_a_healer_receives_from_send_to_it(
    steps, group_rank, init_sync
):
    """A push transport (PGTransport) sends to exactly the healers that
    receive from it: any other send would wait forever for its receiver."""
    by_id = {f"r{i}": s for i, s in enumerate(steps)}
    received, sent = edges(by_id, group_rank, init_sync, 1)
    assert received == sent
    assert len({dst for _, dst in received}) == len(received), "a healer has two sources"


@given(
    steps=st.lists(st.integers(0, 3), min_size=1, max_size=7),
    group_rank=st.integers(0, 3),
    stripes=st.one_of(st.none(), st.integers(2, 4)),
)
def test_striped_every_source_a_healer_fetches_from_serves_it(steps, group_rank, stripes):
    by_id = {f"r{i}": s for i, s in enumerate(steps)}
    received, sent = edges(by_id, group_rank, False, stripes)
    assert received <= sent
    if stripes is None:
        assert received == sent


def slot_quorum(members: dict[str, tuple[int, int | None]]) -> Quorum:
    """Members by id: (step, batch slot claimed or None)."""
    return Quorum(
        quorum_id=9,
        participants=tuple(
            QuorumMember(
                replica_id=rid,
                address="",
                store_address="",
                step=step,
                data="" if slot is None else json.dumps({"slot": slot}),
            )  # fmt: skip
            for rid, (step, slot) in members.items()
        ),
        created=0.0,
    )


@pytest.mark.parametrize(
    "members, wrong, wrong_all",
    [
        ({"a": (3, 0), "b": (3, 1), "c": (3, 2)}, "", ""),
        ({"a": (3, None), "b": (3, None)}, "", ""),  # nobody takes batches by the quorum
        ({"a": (3, 0), "b": (3, None), "c": (3, 2)}, "", ""),
        # c healed last step and is behind no more; b died: c's forecast is off by one.
        ({"a": (3, 0), "c": (3, 2)}, "replica c took batch slot 2 but is participant 1 of 2", "c"),
        # b is behind (heals, trains nothing): the participants are a and c.
        ({"a": (3, 0), "b": (2, 1), "c": (3, 1)}, "", "replica c took batch slot 1"),
        ({"a": (3, 0), "b": (2, 5), "c": (3, 1)}, "", "b took batch slot 5"),
        ({"a": (0, -1), "b": (0, -1)}, "a took no batch slot (it had no quorum yet)", "a"),
    ],
)
def test_batch_slots_are_wrong_when_a_participant_took_another_ones_unit(members, wrong, wrong_all):
    result = compute_quorum_result(slot_quorum(members), "a", 0, init_sync=True)
    assert (wrong in result.batch_slots_wrong) and (bool(wrong) == bool(result.batch_slots_wrong))
    assert wrong_all in result.batch_slots_wrong_all
    assert bool(wrong_all) == bool(result.batch_slots_wrong_all)


@pytest.mark.parametrize(
    "committed, participating, cap, expected",
    [
        (True, (2, 0), None, BatchSlot(slot=2, participants=3)),  # all three commit and count
        (True, (2, 0), 2, BatchSlot(slot=2, participants=2)),  # a spare keeps its rank
        (False, (2, 1), None, BatchSlot(slot=1, participants=2)),  # nobody moved on
        (False, (2, None), None, BatchSlot(slot=-1, participants=2)),
    ],
)
def test_the_slot_forecast_follows_whether_the_step_committed(
    committed, participating, cap, expected
):
    result = compute_quorum_result(quorum({"a": 3, "b": 3, "c": 2}), "c", 0, init_sync=True)
    assert slot_forecast(result, cap, committed, participating) == expected
