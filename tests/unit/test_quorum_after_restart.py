"""The quorum rule right after a lighthouse (re)start: a job already past
step 0 gives its replicas half a heartbeat timeout to reconnect."""

from __future__ import annotations

import pytest

from lighthouse.quorum import (
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
