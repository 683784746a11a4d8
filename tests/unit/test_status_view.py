"""The status page's memory, fed by the membership's effects: no server, time passed in."""

from __future__ import annotations

import json

from lighthouse.core.effects import Outcome
from lighthouse.core.membership import Membership
from lighthouse.core.quorum import LighthouseConfig, QuorumMember
from lighthouse.status.view import StatusView

CONFIG = LighthouseConfig(min_replicas=2, heartbeat_timeout_ms=1000, suspect_phi=0)
WALL = 1_000_000.0


def feed(view: StatusView, outcome: Outcome, now: float) -> Outcome:
    view.observe(outcome.effects, now, now + WALL)
    return outcome


def test_the_history_says_who_joined_and_left_why_and_notes_a_refused_twin():
    m = Membership(CONFIG, started_at=0.0)
    view = StatusView(m)
    for rid in ("g0:a", "g1:b"):
        feed(view, m.join(0.0, QuorumMember(rid)), 0.0)
    feed(view, m.decide(0.0, WALL), 0.0)
    feed(view, m.leave(0.5, 0.5 + WALL, "g1:b"), 0.5)
    feed(view, m.join(0.6, QuorumMember("g1:c")), 0.6)
    feed(view, m.join(0.6, QuorumMember("g0:a", step=1)), 0.6)
    feed(view, m.decide(0.6, 0.6 + WALL), 0.6)
    refused = feed(view, m.heartbeat(0.7, "g0:twin"), 0.7)
    assert refused.error is not None

    page = view.snapshot(0.8, 0.8 + WALL)
    newest, second, first = page["history"]
    assert newest["quorum_id"] is None
    assert newest["note"].startswith("twin refused: replica group 'g0' is already live as g0:a")
    assert second["members"] == ["g0:a", "g1:c"]
    assert second["joined"] == [
        {"replica_id": "g1:c", "why": "new process of group 'g1' (restarted)"}
    ]
    assert second["left"] == [{"replica_id": "g1:b", "why": "left on purpose (Leave)"}]
    assert first["joined"] == [
        {"replica_id": "g0:a", "why": "new"},
        {"replica_id": "g1:b", "why": "new"},
    ]
    # g1:c is behind the max step: it heals from g0:a.
    (heal,) = page["heals"]
    assert (heal["replica_id"], heal["sources"], heal["step"]) == ("g1:c", ["g0:a"], 1)
    assert page["quorum_members"] == ["g0:a", "g1:c"]
    assert [r["replica_id"] for r in page["replicas"]] == ["g0:a", "g1:c"]
    assert page["summary"].startswith("quorum issued: every healthy replica joined")


def test_a_heal_report_fills_in_the_seconds_and_bytes_of_the_heal_seen():
    m = Membership(CONFIG, started_at=0.0)
    view = StatusView(m)
    feed(view, m.join(0.0, QuorumMember("a", address="http://a", step=3)), 0.0)
    feed(view, m.join(0.0, QuorumMember("b", step=0)), 0.0)
    feed(view, m.decide(0.0, WALL), 0.0)
    report = {"heal": {"step": 3, "seconds": 1.5, "bytes": 4096, "sources": ["http://a"]}}
    feed(view, m.join(1.0, QuorumMember("b", step=4, data=json.dumps(report))), 1.0)
    (heal,) = view.snapshot(1.0, 1.0 + WALL)["heals"]
    assert (heal["replica_id"], heal["sources"], heal["seconds"], heal["bytes"]) == (
        "b",
        ["a"],
        1.5,
        4096,
    )
