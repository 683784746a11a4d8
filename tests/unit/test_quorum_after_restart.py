"""The quorum rule right after a lighthouse (re)start: a job already past
step 0 gives its replicas half a heartbeat timeout to reconnect."""

from __future__ import annotations

import pytest

from lighthouse.core.quorum import (
    LighthouseConfig,
    LighthouseState,
    Participant,
    Quorum,
    QuorumMember,
    compute_quorum,
)

NOW = 1000.0
CONFIG = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=2000, join_timeout_ms=5000)


def state(steps: dict[str, int], started_ago: float, joined_ago: float = 0.0, prev=False):
    participants = {
        rid: Participant(QuorumMember(rid, step=step), NOW - joined_ago)
        for rid, step in steps.items()
    }
    prev_quorum = Quorum(1, tuple(QuorumMember(r) for r in steps), 0.0) if prev else None
    return LighthouseState(
        participants, {rid: NOW for rid in steps}, prev_quorum, started_at=NOW - started_ago
    )


@pytest.mark.parametrize(
    "name, st, kind, reason_part",
    [
        ("a job in progress waits after a restart", state({"a": 12}, 0.2), "restart_grace",
         "lighthouse restarted mid-job: waiting 0.8 s for replicas to reconnect"),
        ("until half a heartbeat timeout has passed", state({"a": 12}, 1.0), "valid",
         "every healthy replica joined"),
        ("at most the join timeout", state({"a": 12}, 0.2, joined_ago=5.0), "valid",
         "every healthy replica joined"),
        ("a fresh job (step 0) does not wait", state({"a": 0, "b": 0}, 0.1), "valid",
         "every healthy replica joined"),
        ("nor a lighthouse that issued a quorum", state({"a": 12}, 0.1, prev=True), "fast",
         "fast quorum"),
    ],
)  # fmt: skip
def test_a_restarted_lighthouse_waits_half_a_heartbeat_timeout_for_a_running_job(
    name, st, kind, reason_part
):
    decision = compute_quorum(NOW, st, CONFIG)
    assert decision.kind == kind, decision.reason
    assert reason_part in decision.reason
    assert (decision.members is None) == (kind == "restart_grace")


def restored(joined: dict[str, int], prev: tuple[str, ...], started_ago: float) -> LighthouseState:
    """A lighthouse that read the previous quorum `prev` from its state file."""
    participants = {rid: Participant(QuorumMember(rid, step=s), NOW) for rid, s in joined.items()}
    return LighthouseState(
        participants,
        {rid: NOW for rid in joined},
        Quorum(7, tuple(QuorumMember(r) for r in prev), 0.0),
        started_at=NOW - started_ago,
        high_water_step=12,
        restored=True,
    )


@pytest.mark.parametrize(
    "name, st, kind, reason_part",
    [
        ("every previous member back: no wait", restored({"a": 12, "b": 12}, ("a", "b"), 0.1),
         "fast", "fast quorum"),
        ("one not back yet: waits for it, by name", restored({"a": 12}, ("a", "b"), 0.1),
         "restart_grace", "waiting 0.9 s for previous members b to reconnect"),
        ("at most half a heartbeat timeout", restored({"a": 12}, ("a", "b"), 1.0),
         "valid", "every healthy replica joined"),
        ("a newcomer besides every previous member: no wait",
         restored({"a": 12, "b": 12, "c": 0}, ("a", "b"), 0.1), "fast", "fast quorum"),
    ],
)  # fmt: skip
def test_a_lighthouse_with_its_last_quorum_restored_waits_only_for_its_missing_members(
    name, st, kind, reason_part
):
    decision = compute_quorum(NOW, st, CONFIG)
    assert decision.kind == kind, decision.reason
    assert reason_part in decision.reason
