"""Nobody trains from scratch by accident: the quorum rule vetoes a quorum
whose members are all at step 0 once the job has committed steps (its
high-water mark), unless the operator allows a fresh start. A veto, not a
rule of whom to wait for: stragglers are still waited for first."""

from __future__ import annotations

import pytest

from lighthouse.core.quorum import (
    LighthouseConfig,
    LighthouseState,
    Participant,
    Quorum,
    QuorumMember,
    compute_quorum,
    fresh_start_refusal,
)

NOW = 1000.0
CONFIG = LighthouseConfig(min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=2000)
FRESH = LighthouseConfig(
    min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=2000, allow_fresh_start=True
)


def state(
    joined: dict[str, int],
    mark: int,
    healthy_idle: tuple[str, ...] = (),
    closed: tuple[str, ...] = (),
    prev: tuple[str, ...] | None = None,
    joined_ago: float = 0.0,
    described: dict[str, int] | None = None,
) -> LighthouseState:
    """`joined`: replica -> step, waiting now; `healthy_idle`: heartbeating,
    not waiting; `closed`: heartbeat stream ended (dead); `prev`: the previous quorum."""
    participants = {
        rid: Participant(QuorumMember(rid, step=step), NOW - joined_ago)
        for rid, step in joined.items()
    }
    heartbeats = {rid: NOW - 0.1 for rid in (*joined, *healthy_idle, *closed)}
    prev_quorum = Quorum(7, tuple(QuorumMember(r) for r in prev), 0.0) if prev else None
    return LighthouseState(
        participants,
        heartbeats,
        prev_quorum,
        streams_closed={rid: NOW - 0.05 for rid in closed},
        described={rid: QuorumMember(rid, step=step) for rid, step in (described or {}).items()},
        high_water_step=mark,
    )


@pytest.mark.parametrize(
    "name, st, config, kind, members",
    [
        ("a fresh job starts at 0", state({"a": 0, "b": 0}, mark=0), CONFIG, "valid", "a,b"),
        ("all at 0 past the mark: vetoed", state({"b": 0}, mark=40), CONFIG, "fresh_start", None),
        ("its heal source died (stream closed): vetoed",
         state({"b": 0}, mark=40, closed=("a",), prev=("a", "b")), CONFIG, "fresh_start", None),
        ("a live peer to heal from", state({"a": 40, "b": 0}, mark=40), CONFIG, "valid", "a,b"),
        ("restored from a durable checkpoint below the mark",
         state({"b": 25}, mark=40), CONFIG, "valid", "b"),
        ("a healthy peer not yet asking is waited for first",
         state({"b": 0, "c": 0}, mark=40, healthy_idle=("a",)), CONFIG, "stragglers", None),
        ("... and vetoed once the join timeout leaves it out",
         state({"b": 0, "c": 0}, mark=40, healthy_idle=("a",), joined_ago=6.0), CONFIG,
         "fresh_start", None),
        ("a live holder of the state, between quorums, is waited for, not given up on",
         state({"b": 0, "c": 0}, mark=40, healthy_idle=("a",), joined_ago=6.0,
               described={"a": 40}), CONFIG, "holder_wait", None),
        ("... and the quorum is issued as soon as it asks",
         state({"a": 40, "b": 0, "c": 0}, mark=40), CONFIG, "valid", "a,b,c"),
        ("a holder that died is not waited for",
         state({"b": 0}, mark=40, closed=("a",), described={"a": 40}), CONFIG,
         "fresh_start", None),
        ("the fast quorum is vetoed too",
         state({"b": 0}, mark=40, prev=("b",)), CONFIG, "fresh_start", None),
        ("the operator allows a fresh start",
         state({"b": 0}, mark=40), FRESH, "valid", "b"),
    ],
)  # fmt: skip
def test_a_quorum_all_at_step_0_past_the_mark_is_vetoed(name, st, config, kind, members):
    decision = compute_quorum(NOW, st, config)
    assert decision.kind == kind, decision.reason
    got = None if decision.members is None else ",".join(m.replica_id for m in decision.members)
    assert got == members


def test_the_veto_names_the_mark_why_and_what_to_do():
    decision = compute_quorum(NOW, state({"b": 0}, mark=40, closed=("a",)), CONFIG)
    reason = decision.reason
    assert "refusing to train from step 0" in reason
    assert "step 40" in reason and "high-water mark" in reason
    assert "no live replica group holds a step past 0" in reason
    assert "durable checkpoint" in reason and "--allow-fresh-start" in reason
    assert "gone: heartbeat stream closed: a" in reason  # who is missing, as every stall says


@pytest.mark.parametrize(
    "steps, mark, allow, refused",
    [
        ((0, 0), 0, False, False),
        ((0, 0), 1, False, True),
        ((0, 1), 5, False, False),
        ((0,), 5, True, False),
        ((), 5, False, False),
    ],
)
def test_fresh_start_refusal(steps, mark, allow, refused):
    members = tuple(QuorumMember(f"r{i}", step=s) for i, s in enumerate(steps))
    assert (fresh_start_refusal(members, mark, allow) is not None) == refused
    assert fresh_start_refusal(None, mark, allow) is None


@pytest.mark.parametrize(
    "held, refused",
    [
        (frozenset(), True),  # b never held a step past 0: a newcomer on fresh weights
        (frozenset({"a"}), True),  # the one that held it is gone
        (frozenset({"b"}), False),  # b itself asked at a step past 0 before: its own choice
    ],
)
def test_a_replica_that_held_a_step_itself_may_go_back_to_0(held, refused):
    members = (QuorumMember("b", step=0),)
    assert (fresh_start_refusal(members, 40, False, held) is not None) == refused
