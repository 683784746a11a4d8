"""The membership's high-water mark and what it restores from a state file:
the mark grows with issued quorums, a restored last quorum keeps its id when
its members come back, and a refused fresh start is logged at once and
answered after FRESH_START_HOLD_S. Events in, effects out; no server."""

from __future__ import annotations

import logging

from lighthouse.core.membership import FRESH_START_HOLD_S, Fail, Issued, Log, Membership
from lighthouse.core.quorum import JobMark, LighthouseConfig, QuorumMember
from lighthouse.rpc.errors import FreshStartRefusedError

CONFIG = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=1000, suspect_phi=0)
WALL = 1_000_000.0


def issued(outcome) -> list[Issued]:  # type: ignore[no-untyped-def]
    return [e for e in outcome.effects if isinstance(e, Issued)]


def test_the_mark_is_the_highest_step_of_any_issued_quorum():
    m = Membership(CONFIG, started_at=0.0)
    m.join(0.0, QuorumMember("a", step=0))
    m.join(0.0, QuorumMember("b", step=0))
    assert issued(m.decide(0.1, WALL)) and m.high_water_step == 0
    m.join(1.0, QuorumMember("a", step=7))
    m.join(1.0, QuorumMember("b", step=3))
    assert issued(m.decide(1.1, WALL)) and m.high_water_step == 7
    m.join(2.0, QuorumMember("a", step=5))  # lower later (a durable restart): the mark stays
    m.join(2.0, QuorumMember("b", step=5))
    assert issued(m.decide(2.1, WALL)) and m.high_water_step == 7


def test_a_restored_quorum_keeps_its_id_when_its_members_come_back():
    restored = JobMark(high_water_step=40, quorum_id=123, members=("b", "a"), saved_at=5.0)
    m = Membership(CONFIG, started_at=0.0, restored=restored)
    assert m.prev_quorum is not None and m.prev_quorum.replica_ids() == ("a", "b")
    m.join(0.1, QuorumMember("a", step=41))
    assert not issued(m.decide(0.1, WALL))  # b not back: the restart grace
    assert "previous members b" in m.reason
    m.join(0.2, QuorumMember("b", step=41))
    [quorum] = issued(m.decide(0.2, WALL))
    # The same members: the groups keep their process groups (no reconfigure).
    assert quorum.quorum.quorum_id == 123 and not quorum.changed
    assert m.high_water_step == 41 and not m.restored


def test_a_restored_quorum_with_other_members_gets_a_new_id():
    restored = JobMark(high_water_step=40, quorum_id=123, members=("a", "b"), saved_at=5.0)
    m = Membership(CONFIG, started_at=0.0, restored=restored)
    m.join(0.1, QuorumMember("a", step=41))
    [quorum] = issued(m.decide(0.6, WALL))  # after half a heartbeat timeout, without b
    assert quorum.changed and quorum.quorum.quorum_id > 123


def test_a_refused_fresh_start_is_logged_at_once_and_answered_after_the_hold():
    m = Membership(CONFIG, started_at=0.0, restored=JobMark(high_water_step=40))
    ticket = m.join(0.0, QuorumMember("b", step=0)).ticket
    first = m.decide(0.1, WALL)
    assert not issued(first)
    [log] = [e for e in first.effects if isinstance(e, Log)]
    assert log.level == logging.WARNING and "refusing to train from step 0" in str(log.args)
    assert not [e for e in first.effects if isinstance(e, Fail)]  # held: a peer may come
    m.heartbeat(0.9, "b")
    assert not [e for e in m.decide(1.0, WALL).effects if isinstance(e, Log)]  # said once
    for t in (1.8, 2.7):
        m.heartbeat(t, "b")
    [fail] = [e for e in m.decide(FRESH_START_HOLD_S, WALL).effects if isinstance(e, Fail)]
    assert fail.ticket == ticket and isinstance(fail.error, FreshStartRefusedError)
    assert "step 40" in str(fail.error) and not m.participants


def test_a_peer_that_comes_within_the_hold_is_healed_from():
    m = Membership(CONFIG, started_at=0.0, restored=JobMark(high_water_step=40))
    m.join(0.0, QuorumMember("b", step=0))
    assert not issued(m.decide(0.1, WALL))
    m.heartbeat(0.9, "b")
    m.join(1.0, QuorumMember("a", step=40))
    [quorum] = issued(m.decide(1.1, WALL))
    assert quorum.quorum.replica_ids() == ("a", "b")
