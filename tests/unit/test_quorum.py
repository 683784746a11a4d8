"""Table-driven tests of the pure quorum decision: no sockets, time passed in."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from lighthouse.core.quorum import (
    ArrivalStats,
    LighthouseConfig,
    LighthouseState,
    Participant,
    Quorum,
    QuorumMember,
    compute_quorum,
    forgotten_replicas,
    group_name,
    next_quorum_id,
    quorum_changed,
    record_arrival,
    suspected_replicas,
    suspicion,
    twin_refusal,
)

NOW = 1000.0
CONFIG = LighthouseConfig(min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=1000)


def member(
    rid: str, *, step: int = 0, shrink_only: bool = False, failures: int = 0
) -> QuorumMember:
    return QuorumMember(
        replica_id=rid, step=step, shrink_only=shrink_only, commit_failures=failures
    )


def state(
    joined: dict[str, float],
    beats: dict[str, float] | None = None,
    prev: list[str] | None = None,
    shrink_only: tuple[str, ...] = (),
    closed: dict[str, float] | None = None,
) -> LighthouseState:
    """joined: replica -> seconds ago it joined; beats: replica -> seconds since
    heartbeat; closed: replica -> seconds since its heartbeat stream ended.

    Joined replicas heartbeat just now unless `beats` says otherwise.
    """
    heartbeats = {rid: NOW for rid in joined}
    heartbeats.update({rid: NOW - ago for rid, ago in (beats or {}).items()})
    participants = {
        rid: Participant(member(rid, shrink_only=rid in shrink_only), NOW - ago)
        for rid, ago in joined.items()
    }
    prev_quorum = Quorum(1, tuple(member(r) for r in prev), 0.0) if prev is not None else None
    streams_closed = {rid: NOW - ago for rid, ago in (closed or {}).items()}
    return LighthouseState(participants, heartbeats, prev_quorum, streams_closed)


@pytest.mark.parametrize(
    "name, st, expected_members, kind, reason_part",
    [
        ("too few replicas", state({"a": 0}), None, "too_few", "min_replicas is 2"),
        (
            "waits for a healthy straggler until the join timeout",
            state({"a": 1, "b": 0}, beats={"c": 0.1}),
            None,
            "stragglers",
            "waiting for 1 healthy straggler, join timeout in 4.0 s [2/3 participants healthy]",
        ),
        (
            "forms without the straggler after the join timeout",
            state({"a": 6, "b": 0}, beats={"c": 0.1}),
            ["a", "b"],
            "join_timeout",
            "join timeout passed",
        ),
        (
            "forms when every healthy replica joined",
            state({"a": 0, "b": 0}),
            ["a", "b"],
            "valid",
            "[2/2",
        ),
        (
            "split brain guard needs more than half of the healthy replicas",
            state({"a": 0, "b": 0}, beats={"c": 0.1, "d": 0.1}),
            None,
            "split_brain",
            "2 joined of 4 healthy",
        ),
        (
            "fast quorum once every previous member joined",
            state({"a": 0, "b": 0}, beats={"c": 0.1}, prev=["a", "b"]),
            ["a", "b"],
            "fast",
            "fast quorum",
        ),
        (
            "fast quorum takes new joiners along",
            state({"a": 0, "b": 0, "c": 0}, prev=["a", "b"]),
            ["a", "b", "c"],
            "fast",
            "fast quorum",
        ),
        (
            "no fast quorum while a previous member is missing",
            state({"a": 0, "c": 0}, beats={"b": 0.1}, prev=["a", "b"]),
            None,
            "stragglers",
            "1 healthy straggler",
        ),
        (
            "shrink_only keeps new replicas out",
            state({"a": 0, "b": 0, "c": 0}, prev=["a", "b"], shrink_only=("a",)),
            ["a", "b"],
            "fast",
            "[shrink_only]",
        ),
        (
            "shrink_only without enough previous members waits",
            state({"a": 0, "c": 0}, prev=["a", "b"], shrink_only=("a",)),
            None,
            "too_few",
            "1 joined",
        ),
        (
            "an expired heartbeat makes a replica unhealthy",
            state({"a": 0, "b": 0}, beats={"c": 1.5}),
            ["a", "b"],
            "valid",
            "[2/2 participants healthy]",
        ),
        (
            "a participant with an expired heartbeat does not count",
            state({"a": 0, "b": 0}, beats={"b": 2}),
            None,
            "too_few",
            "[1/1 participants healthy]",
        ),
        (
            "a dead previous member does not block after the others join",
            state({"a": 0, "b": 0}, beats={"c": 3}, prev=["a", "b", "c"]),
            ["a", "b"],
            "valid",
            "every healthy replica joined",
        ),
        (
            "a member whose stream closed after its last heartbeat is not waited for",
            state({"a": 0, "c": 0}, beats={"b": 0.5}, prev=["a", "b", "c"], closed={"b": 0.2}),
            ["a", "c"],
            "valid",
            "every healthy replica joined [2/2 participants healthy]"
            "[1 gone: heartbeat stream closed: b]",
        ),
        (
            "a closed stream does not count against the majority",
            state({"a": 0}, beats={"b": 0.3, "c": 0.3}, closed={"b": 0.1, "c": 0.2}),
            None,
            "too_few",
            "[1/1 participants healthy][2 gone: heartbeat stream closed: b, c]",
        ),
        (
            "a heartbeat after the stream closed makes the replica healthy again",
            state({"a": 0, "c": 0}, beats={"b": 0.1}, prev=["a", "b", "c"], closed={"b": 0.2}),
            None,
            "stragglers",
            "waiting for 1 healthy straggler, join timeout in 5.0 s [2/3 participants healthy]",
        ),
        (
            "a slow member with its stream open is waited for",
            state({"a": 0, "c": 0}, beats={"b": 0.9}, prev=["a", "b", "c"]),
            None,
            "stragglers",
            "waiting for 1 healthy straggler",
        ),
        (
            "a participant whose stream closed is left out",
            state({"a": 0, "b": 1, "c": 0}, beats={"b": 0.5}, closed={"b": 0.4}),
            ["a", "c"],
            "valid",
            "[2/2 participants healthy][1 gone: heartbeat stream closed: b]",
        ),
        (
            "a closed stream past the heartbeat timeout is an expired replica, not news",
            state({"a": 0, "c": 0}, beats={"b": 2}, closed={"b": 1.5}),
            ["a", "c"],
            "valid",
            "every healthy replica joined [2/2 participants healthy]",
        ),
    ],
)
def test_compute_quorum(name, st, expected_members, kind, reason_part):
    decision = compute_quorum(NOW, st, CONFIG)
    got = None if decision.members is None else [m.replica_id for m in decision.members]
    assert got == expected_members, decision.reason
    assert decision.kind == kind
    assert reason_part in decision.reason
    if "gone" not in reason_part:
        assert "gone" not in decision.reason


def test_members_are_sorted_by_replica_id():
    decision = compute_quorum(NOW, state({"c": 0, "a": 0, "b": 0}), CONFIG)
    assert [m.replica_id for m in decision.members] == ["a", "b", "c"]


@pytest.mark.parametrize(
    "prev, members, changed",
    [
        (None, ["a"], True),
        (["a", "b"], ["a", "b"], False),
        (["a", "b"], ["a", "b", "c"], True),
        (["a", "b"], ["a"], True),
        (["a", "b"], ["a", "c"], True),
    ],
)
def test_quorum_id_grows_only_on_member_change(prev, members, changed):
    prev_quorum = Quorum(7, tuple(member(r) for r in prev), 0.0) if prev else None
    assert quorum_changed(prev_quorum, tuple(member(r) for r in members)) is changed


def test_quorum_id_grows_when_a_member_reports_commit_failures():
    prev = Quorum(7, (member("a"), member("b")), 0.0)
    assert quorum_changed(prev, (member("a"), member("b", failures=1)))


@pytest.mark.parametrize(
    "prev_id, wall_ms, expected",
    [
        (0, 1_700_000_000_000, 1_700_000_000_000),
        (1_700_000_000_005, 1_700_000_000_000, 1_700_000_000_006),
    ],
)
def test_next_quorum_id_is_above_the_previous_and_the_clock(prev_id, wall_ms, expected):
    assert next_quorum_id(prev_id, wall_ms) == expected


def test_silent_replicas_are_forgotten():
    beats = {"old": NOW - 100, "recent": NOW - 1}
    assert forgotten_replicas(NOW, beats, 60) == ["old"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_replicas": 0}, "min_replicas (0) must be at least 1"),
        (
            {"min_replicas": 1, "heartbeat_timeout_ms": 0},
            "heartbeat_timeout_ms (0) must be positive",
        ),
        ({"min_replicas": 1, "quorum_tick_ms": -5}, "quorum_tick_ms (-5) must be positive"),
    ],
)
def test_bad_config_is_refused_with_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LighthouseConfig(**kwargs)


# ---- twin groups -----------------------------------------------------------------


@pytest.mark.parametrize(
    "replica_id, name",
    [("train_ddp_0:9f1c", "train_ddp_0"), ("a:b:uuid", "a:b"), ("plain", "plain"), (":u", "")],
)
def test_the_group_name_is_the_id_before_its_last_colon(replica_id, name):
    assert group_name(replica_id) == name


@pytest.mark.parametrize(
    "case, same_name, beats, closed, refused",
    [
        ("first of its name", [], {}, {}, False),
        ("only itself known (its own later calls)", ["g:new"], {"g:new": 0.1}, {}, False),
        ("another of the name is live", ["g:old"], {"g:old": 0.1}, {}, True),
        ("the other is silent past the heartbeat timeout", ["g:old"], {"g:old": 1.5}, {}, False),
        ("the other's stream closed after its last beat", ["g:old"], {"g:old": 0.5},
         {"g:old": 0.2}, False),
        ("the other's stream closed but it beat since", ["g:old"], {"g:old": 0.1},
         {"g:old": 0.3}, True),
        ("the index names one with no heartbeat", ["g:gone"], {}, {}, False),
        ("one of two others is live", ["g:a", "g:b"], {"g:a": 3.0, "g:b": 0.2}, {}, True),
    ],
)  # fmt: skip
def test_a_second_live_replica_of_one_group_is_refused_until_the_first_is_dead(
    case, same_name, beats, closed, refused
):
    heartbeats = {rid: NOW - ago for rid, ago in beats.items()}
    streams_closed = {rid: NOW - ago for rid, ago in closed.items()}
    reason = twin_refusal(
        NOW, "g:new", same_name, heartbeats, CONFIG.heartbeat_timeout_ms, streams_closed
    )
    if not refused:
        assert reason is None, case
        return
    assert reason is not None, case
    live = next(rid for rid in same_name if rid in beats and beats[rid] < 1.0)
    assert f"replica group 'g' is already live as {live}" in reason
    assert "refusing g:new" in reason and "another REPLICA_GROUP_ID" in reason


# ---- hang detection (phi accrual) ------------------------------------------------


def rhythm(intervals: list[float]) -> ArrivalStats:
    stats = None
    for x in intervals:
        stats = record_arrival(stats, x, cap_s=1.0)
    assert stats is not None
    return stats


REGULAR = rhythm([0.1] * 30)
JITTERY = rhythm([0.1, 0.6] * 15)  # a loaded machine: heartbeats up to 0.6 s apart


def test_the_rhythm_tracks_the_mean_and_caps_an_outage_at_the_cap():
    assert REGULAR.mean_s == pytest.approx(0.1) and REGULAR.var_s2 == pytest.approx(0.0)
    assert REGULAR.count == 30
    after_outage = record_arrival(REGULAR, 60.0, cap_s=1.0)
    assert after_outage.mean_s == pytest.approx(0.1 + 0.1 * 0.9)


@pytest.mark.parametrize(
    "stats, silence_s, suspected",
    [
        (REGULAR, 0.1, False),
        (REGULAR, 0.3, False),  # slow, but below suspect_min_ms (700)
        (REGULAR, 0.75, True),
        (JITTERY, 0.75, False),  # the same silence is ordinary for a jittery sender
        (JITTERY, 2.5, True),
        (rhythm([0.1] * 5), 0.9, False),  # too few intervals to know its rhythm
    ],
)
def test_a_replica_is_suspected_only_when_silent_far_beyond_its_own_rhythm(
    stats, silence_s, suspected
):
    found = suspected_replicas(NOW, {"a": NOW - silence_s}, {"a": stats}, CONFIG)
    assert ("a" in found) == suspected


def test_suspicion_grows_with_silence_and_is_off_at_phi_zero():
    assert suspicion(0.2, REGULAR) < suspicion(0.4, REGULAR) < suspicion(0.6, REGULAR)
    off = LighthouseConfig(min_replicas=2, suspect_phi=0)
    assert suspected_replicas(NOW, {"a": NOW - 3.0}, {"a": REGULAR}, off) == {}


def hung_state(silence_s: float, stats: ArrivalStats, waiting: bool = False) -> LighthouseState:
    """a and b wait; c (a previous member) last heard `silence_s` ago."""
    base = state({"a": 0.0, "b": 0.0, **({"c": silence_s} if waiting else {})},
                 beats={"c": silence_s}, prev=["a", "b", "c"])  # fmt: skip
    return replace(base, arrivals={"a": REGULAR, "b": REGULAR, "c": stats})


@pytest.mark.parametrize("waiting", [False, True], ids=["straggling", "waiting"])
def test_a_hung_replica_is_left_out_at_once_when_the_others_are_ready(waiting):
    decision = compute_quorum(NOW, hung_state(0.8, REGULAR, waiting), CONFIG)
    assert decision.members is not None
    assert [m.replica_id for m in decision.members] == ["a", "b"]
    assert "1 suspected hung: c silent 0.8 s, usually every 0.10 s" in decision.reason


def test_a_slow_but_ordinary_replica_is_still_waited_for():
    decision = compute_quorum(NOW, hung_state(0.8, JITTERY), CONFIG)
    assert decision.members is None and decision.kind == "stragglers"


@pytest.mark.parametrize(
    "overrides, message",
    [({"suspect_phi": -1}, "suspect_phi (-1) must be 0 (off) or positive"),
     ({"suspect_min_ms": -5}, "suspect_min_ms (-5) must not be negative")],
)  # fmt: skip
def test_bad_suspicion_settings_are_refused_naming_the_value(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LighthouseConfig(min_replicas=1, **overrides)
